"""`--kv-cache-dtype`: a 16-bit KV cache under float32 weights on the CPU holds keys and values rounded once,
when stored, and computes everything else in float32."""

from __future__ import annotations

import pytest
import torch

from lmgate.engine.config import EngineConfig
from lmgate.engine.engine import Engine
from lmgate.engine.errors import InvalidRequest
from lmgate.engine.step.kv_cache import kv_cache_dtype
from lmgate.engine.sampling.sampler import SamplingParams

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=1)


def test_auto_keeps_the_models_dtype_and_other_choices_are_checked():
    assert kv_cache_dtype("auto", torch.bfloat16, CUDA) is torch.bfloat16
    assert kv_cache_dtype("float16", torch.float32, CPU) is torch.float16
    assert kv_cache_dtype("float32", torch.float32, CUDA) is torch.float32  # the model's own dtype: anywhere
    for name, dtype, device in [
        ("float16", torch.bfloat16, CPU),
        ("bfloat16", torch.float32, CUDA),
        ("float32", torch.bfloat16, CPU),
    ]:
        with pytest.raises(InvalidRequest, match="kv-cache-dtype"):
            kv_cache_dtype(name, dtype, device)
    with pytest.raises(InvalidRequest, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def runs(checkpoint, tokenizer) -> dict:
    """The same prompts through float32 weights over each KV cache dtype, and quantized weights (whose decode
    steps run in one C++ call, tests/test_quantized.py) over float16."""
    prompts = [
        tokenizer.encode(t)
        for t in ("The capital of France is", "Once upon a time, there was a little", "def fibonacci(n):\n    ")
    ]
    out = {}
    for weights, kv in [("float", "float32"), ("float", "float16"), ("float", "bfloat16"), ("quantized", "float16")]:
        config = EngineConfig(dtype="float32", weights=weights, kv_cache_dtype=kv, kv_cache_tokens=2048)
        with Engine(config, checkpoint=checkpoint) as engine:
            streams = [engine.submit(ids, PARAMS) for ids in prompts]
            outputs = [[o for o in s] for s in streams]
            info = engine.info()
            assert info.kv_blocks_free == info.kv_blocks_total
            cache = engine.loops[0].runner.kv_caches[0][0]
            out[weights, kv] = (outputs, info.kv_cache_bytes, engine.kv_bytes_per_token, cache.dtype)
    return out


@pytest.mark.parametrize("kv,max_logprob_error", [("float16", 0.02), ("bfloat16", 0.15)])
def test_a_16_bit_cache_takes_half_the_bytes_and_keeps_the_greedy_tokens(runs, kv, max_logprob_error):
    want, want_bytes, want_per_token, _ = runs["float", "float32"]
    got, got_bytes, got_per_token, dtype = runs["float", kv]
    assert dtype == getattr(torch, kv)
    assert got_bytes * 2 == want_bytes and got_per_token * 2 == want_per_token
    for want_outs, got_outs in zip(want, got):
        assert [t for o in got_outs for t in o.token_ids] == [t for o in want_outs for t in o.token_ids]
        errors = [
            abs(g.logprob - w.logprob)
            for g, w in zip((lp for o in got_outs for lp in o.logprobs), (lp for o in want_outs for lp in o.logprobs))
        ]
        assert len(errors) == PARAMS.max_new_tokens and max(errors) < max_logprob_error


def test_quantized_weights_over_a_float16_cache(runs):
    want, *_ = runs["float", "float16"]
    got, _, _, dtype = runs["quantized", "float16"]
    assert dtype == torch.float16
    for want_outs, got_outs in zip(want, got):
        assert [t for o in got_outs for t in o.token_ids] == [t for o in want_outs for t in o.token_ids]
