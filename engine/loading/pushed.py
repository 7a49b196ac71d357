"""Weights pushed from a caller's memory (a trainer's), by Hugging Face name: checked against the served
model's shapes before a byte of them is read, then built as a checkpoint's weights are (`LocalWeights.load`)."""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..config import ModelConfig
from ..errors import InvalidRequest
from ..models.llama import hf_weight_shapes

# The dtypes a pushed tensor may have, by wire name; each is served in the engine's dtype.
PUSH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One pushed tensor as announced before its bytes: Hugging Face name, dtype (of PUSH_DTYPES), shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * PUSH_DTYPES[self.dtype].itemsize


@dataclass(slots=True)
class PushedWeights:
    """A whole model's weights from memory: the config they are served with and the tensors by Hugging Face
    name. Held in host memory while served, as a path is: a level-2 sleep's restore builds from them again."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]


def check_specs(specs: Sequence[TensorSpec], config: ModelConfig) -> None:
    """Refuses (InvalidRequest, naming it) the first tensor the served model has not, by name, shape or dtype,
    one named twice, and a set that lacks any weight: partial updates are not supported yet. A tied model's
    `lm_head.weight` may be left out (its embedding's is served)."""
    expected = hf_weight_shapes(config)
    seen: set[str] = set()
    for spec in specs:
        if spec.name not in expected:
            raise InvalidRequest(f"unknown tensor {spec.name!r}: the served {config.architecture} has no such weight")
        if spec.name in seen:
            raise InvalidRequest(f"tensor {spec.name!r} is sent twice")
        if spec.dtype not in PUSH_DTYPES:
            raise InvalidRequest(
                f"tensor {spec.name!r} has dtype {spec.dtype!r}; pushed weights are one of {list(PUSH_DTYPES)}"
            )
        if tuple(spec.shape) != expected[spec.name]:
            raise InvalidRequest(
                f"tensor {spec.name!r} has shape {list(spec.shape)}; the served model's is {list(expected[spec.name])}"
            )
        seen.add(spec.name)
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(expected.keys() - seen - optional)
    if missing:
        raise InvalidRequest(
            f"{len(missing)} weights are missing (such as {missing[0]!r}): an update sends every weight of the "
            "model (partial updates are not supported yet)"
        )


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return TensorSpec(name, dtype, tuple(tensor.shape))


def pushed_weights(tensors: Mapping[str, torch.Tensor], config: ModelConfig, owned: bool = False) -> PushedWeights:
    """`tensors` checked (`check_specs`) and held as the served model's next weights: copies on the CPU, so
    that a trainer's later steps, in place, change nothing served; held as they are where they are `owned`
    (host tensors no one else writes, such as those received over the wire: no second copy of a model)."""
    check_specs([spec_of(name, t) for name, t in tensors.items()], config)
    held = {name: t if owned else t.detach().to("cpu", copy=True) for name, t in tensors.items()}
    if config.tie_word_embeddings:
        held.pop("lm_head.weight", None)  # the embedding's is served
    return PushedWeights(config, held)


def host_buffer(nbytes: int) -> memoryview:
    """`nbytes` of host memory for received tensors, left unwritten: a kept buffer of that size that nothing views
    any more (`_KeptBuffers`), else a new one. Never `release()` the memoryview: the tensors made from it would
    no longer hold the buffer, which could then be handed out again. A `bytearray` zeroes its pages first, and
    numpy's (which it asks to be huge) took 0.6 s a 0.54 GB model to fill on the 2-core EPYC against 0.19 s for
    torch's."""
    return _kept.take(nbytes)


def release_kept_buffers() -> None:
    """Let go of the kept buffers (a level-2 sleep, whose point is memory; shutdown): those nothing views are
    freed now, the others when their views go."""
    _kept.clear()


class _KeptBuffers:
    """The buffers pushes were received into, kept with their pages once nothing views them, so that the next
    push of the same size is received into memory already faulted in: on the 2-core EPYC, writing 2.47 GB into
    fresh pages took 1.3-1.9 s, into those of a kept buffer 0.2 s. Each buffer is handed out as a new numpy
    array over it, of which every tensor made from the memoryview holds a reference: the buffer is free once
    that array is gone (a weak reference says so), whoever held its views (a push's tensors, a model built on
    them, a level-2 sleep's source). At most KEPT are kept, in use or not; the one handed out last is kept
    first. The lock is a leaf, held for list operations only, and no finalizer takes it."""

    KEPT = 2  # a push's buffer, and the one before it, held as the weights' source until the push replaces it

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: list[tuple[torch.Tensor, weakref.ref]] = []  # (memory, the array handed out over it)

    def take(self, nbytes: int) -> memoryview:
        with self._lock:
            # A free buffer of another size goes: pushes of another dtype, or another model, will not need it
            self._buffers = [b for b in self._buffers if b[1]() is not None or b[0].numel() == nbytes]
            found = next((i for i, (_, handed) in enumerate(self._buffers) if handed() is None), None)
            base = self._buffers.pop(found)[0] if found is not None else torch.empty(nbytes, dtype=torch.uint8)
            array = base.numpy()
            self._buffers.insert(0, (base, weakref.ref(array)))
            del self._buffers[self.KEPT :]  # the oldest in use is only no longer kept: its views still hold it
        return array.data

    def clear(self) -> None:
        with self._lock:
            self._buffers = []


_kept = _KeptBuffers()


def tensor_views(
    specs: Sequence[TensorSpec], buffer: memoryview | bytearray, offsets: Sequence[int] | None = None
) -> dict[str, torch.Tensor]:
    """Each spec's tensor, a view of its bytes in `buffer`: at `offsets`, else packed in the specs' order (the
    engine copies what it keeps). Views of one storage, so that neighbours join without a copy (Q, K and V into
    one projection: `cat_rows`); a tensor its dtype cannot view there (after an odd count of bfloat16 elements,
    say) gets a storage of its own."""
    whole = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
    tensors, at = {}, 0
    for i, spec in enumerate(specs):
        at = offsets[i] if offsets is not None else at
        dtype = PUSH_DTYPES[spec.dtype]
        count = spec.nbytes // dtype.itemsize
        if not count:
            flat = torch.empty(0, dtype=dtype)
        elif at % dtype.itemsize == 0:
            flat = whole[at : at + spec.nbytes].view(dtype)
        else:
            flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=at)
        tensors[spec.name] = flat.view(spec.shape)
        at += spec.nbytes
    return tensors
