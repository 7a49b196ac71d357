"""lmgate's engine: usable as a library on its own (see README.md here for its contract).

Before anything imports torch: OpenMP threads that wait at a barrier sleep instead of spinning, unless the
environment says otherwise. On a 2-core machine with one busy process beside the engine, spinning threads
wait for a thread the neighbour has displaced: 64 streams fell from 198 to 86 tokens/s (ACTIVE) and from
193 to 77 (libgomp's default), where sleeping waiters kept 144 of 181 and 162 of 207. The price, on an
idle machine, was 1-8% in those runs. libgomp reads the variable once, when torch loads it.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The public names, imported when first asked for (`from lmgate.engine import Engine`): importing a submodule
# (`lmgate.engine.errors`) does not build the whole engine.
_PUBLIC = {
    "Engine": "engine",
    "EngineConfig": "config",
    "SamplingParams": "sampling.sampler",
    "RequestOutput": "gateway.request",
    "FinishReason": "gateway.request",
    "EngineError": "errors",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
