"""Pushed weights on their way to this machine's rank processes (engine/ranks/shared_weights.py): one file in
/dev/shm, mapped copy-on-write by each rank, and the tensors in messages where that file has no room. The
served path end to end is tests/test_weight_push.py's (two rank processes)."""

from __future__ import annotations

import os

import pytest
import torch

from lmgate.engine.loading.pushed import PushedWeights
from lmgate.engine.ranks import shared_weights
from lmgate.engine.ranks.shared_weights import share


def shared_files() -> set[str]:
    """The weights' files in /dev/shm now (none where there is no /dev/shm)."""
    if not os.path.isdir(shared_weights.SHM_DIR):
        return set()
    return {n for n in os.listdir(shared_weights.SHM_DIR) if n.startswith("lmgate-weights-")}


needs_shm = pytest.mark.skipif(not os.path.isdir(shared_weights.SHM_DIR), reason="no /dev/shm on this machine")


@needs_shm
def test_each_rank_reads_the_pushed_tensors_and_writes_only_its_own_copy(checkpoint):
    tensors = {
        "a": torch.arange(12, dtype=torch.float32).view(3, 4),
        "b": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),  # 6 bytes: "c" starts unaligned
        "c": torch.arange(6, dtype=torch.float16).view(2, 3).t(),  # not contiguous
    }
    shared = share(PushedWeights(checkpoint.config, tensors))
    assert shared is not None
    try:
        first, second = shared.open(), shared.open()
    finally:
        os.unlink(shared.path)
    for name, tensor in tensors.items():
        assert torch.equal(first.tensors[name], tensor) and first.tensors[name].dtype == tensor.dtype
    first.tensors["a"].neg_()  # a rank writing its weights in place, after the file is gone
    first.tensors["c"].zero_()
    assert torch.equal(second.tensors["a"], tensors["a"]) and torch.equal(second.tensors["c"], tensors["c"])
    assert torch.equal(first.tensors["a"], -tensors["a"])


@needs_shm
def test_weights_the_shared_memory_has_no_room_for_are_left_to_the_messages(checkpoint):
    """A size no tmpfs holds (a container's /dev/shm is often 64 MiB): refused before a byte is written, which
    past a full tmpfs would kill the writer, and no file left behind."""
    before = shared_files()
    huge = torch.empty(2**50, dtype=torch.float32, device="meta")  # 4 PiB, never allocated
    assert share(PushedWeights(checkpoint.config, {"x": huge})) is None
    assert shared_files() == before
