"""Pushed weights on their way to the rank processes (engine/ranks/weight_transfer.py): one file in /dev/shm,
mapped copy-on-write by each rank on this machine, or their bytes in the messages. The served path end to end
is tests/test_weight_push.py's (two rank processes, and one without /dev/shm)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys

import pytest
import torch

from lmgate.engine.loading.pushed import PushedWeights, spec_of, tensor_views
from lmgate.engine.models.quantized_linear import cat_rows
from lmgate.engine.ranks import weight_transfer
from lmgate.engine.ranks.weight_transfer import pack, remove_stale, share, shared_buffer


def shared_files() -> set[str]:
    """This process's weights' files in /dev/shm now (none where there is no /dev/shm); other runs' may come
    and go meanwhile."""
    if not os.path.isdir(weight_transfer.SHM_DIR):
        return set()
    mine = f"{weight_transfer.PREFIX}{os.getpid()}-"
    return {n for n in os.listdir(weight_transfer.SHM_DIR) if n.startswith(mine)}


needs_shm = pytest.mark.skipif(not os.path.isdir(weight_transfer.SHM_DIR), reason="no /dev/shm on this machine")


TENSORS = {
    "a": torch.arange(12, dtype=torch.float32).view(3, 4),
    "b": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),  # 6 bytes: "c" starts unaligned
    "c": torch.arange(6, dtype=torch.float16).view(2, 3).t(),  # not contiguous
}


@needs_shm
def test_each_rank_reads_the_pushed_tensors_and_writes_only_its_own_copy(checkpoint):
    tensors = TENSORS
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


def test_packed_weights_are_the_pushed_tensors_after_a_trip_through_pickle(checkpoint):
    """As a rank on another machine gets them: its own bytes, which it may write."""
    packed = pickle.loads(pickle.dumps(pack(PushedWeights(checkpoint.config, TENSORS))))
    opened = packed.open()
    for name, tensor in TENSORS.items():
        assert torch.equal(opened.tensors[name], tensor) and opened.tensors[name].dtype == tensor.dtype
    opened.tensors["a"].neg_()
    assert torch.equal(packed.open().tensors["a"], -TENSORS["a"])


def test_received_neighbours_join_into_one_projection_without_a_copy():
    """Q, K and V received back to back (as a trainer's `state_dict()` orders them) are one view where the served
    QKV weight is written from; a tensor its dtype cannot view where it lies (after an odd count of bfloat16
    elements) is read and written through memory of its own, the buffer's bytes all the same."""
    sent = {
        "q": torch.randn(4, 8, dtype=torch.bfloat16),
        "k": torch.randn(2, 8, dtype=torch.bfloat16),
        "odd": torch.randn(3, dtype=torch.bfloat16),
        "f": torch.randn(5),
    }
    specs = [spec_of(name, t) for name, t in sent.items()]
    buffer = bytearray(sum(spec.nbytes for spec in specs))
    received = tensor_views(specs, memoryview(buffer))
    for name, tensor in sent.items():
        received[name].copy_(tensor)
    joined = cat_rows([received["q"], received["k"]])
    assert joined.data_ptr() == received["q"].data_ptr() and torch.equal(joined, torch.cat([sent["q"], sent["k"]]))
    assert bytes(buffer[-20:]) == sent["f"].numpy().tobytes()  # 16 + 8 + 6 bytes in: no float32 view there


@needs_shm
def test_tensors_received_into_a_shared_buffer_reach_the_ranks_without_a_copy(checkpoint):
    """A push received into `shared_buffer` (as the server receives one for its rank processes) is handed over
    as that very file, which is kept for the next push of its size: received into again only once nothing here
    views it and every rank it was lent to has said it let go of it; removed when the kept files are let go."""
    before = shared_files()
    specs = [spec_of(name, t) for name, t in TENSORS.items()]
    nbytes = sum(spec.nbytes for spec in specs)
    buffer = shared_buffer(nbytes)
    assert buffer is not None
    received = tensor_views(specs, buffer)
    for view, tensor in zip(received.values(), TENSORS.values()):
        view.copy_(tensor)
    shared = share(PushedWeights(checkpoint.config, received))
    assert shared is not None and shared_files() == before | {os.path.basename(shared.path)}  # no second file
    assert weight_transfer.lend(shared.path, {0, 1})
    copied = share(PushedWeights(checkpoint.config, received))  # pushed again while lent: into a file of its own
    assert copied is not None and copied.path != shared.path and not weight_transfer.lend(copied.path, {0})
    weight_transfer.remove(copied.path)
    opened = shared.open()
    for name, tensor in TENSORS.items():
        assert torch.equal(opened.tensors[name], tensor)
    del buffer, received, view
    assert weight_transfer.awaits_ranks(nbytes)  # free here, lent to ranks 0 and 1
    weight_transfer.released([shared.path], 0)
    second = shared_buffer(nbytes)  # rank 1 may still map the first: a new file
    assert second is not None and len(shared_files() - before) == 2
    weight_transfer.released([shared.path], 1)
    again = shared_buffer(nbytes)
    assert again is not None and len(shared_files() - before) == 2
    assert share(PushedWeights(checkpoint.config, tensor_views(specs, again))).path == shared.path
    del second
    weight_transfer.release_kept_files()
    assert shared_files() - before == {os.path.basename(shared.path)}  # the one `again` views, until it goes
    del again
    assert shared_files() == before
    assert torch.equal(opened.tensors["a"], TENSORS["a"])  # a rank's mapping outlives the file


@needs_shm
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc on this machine")
@pytest.mark.parametrize("through_a_link", [False, True])
def test_a_rank_names_each_file_it_let_go_of_once_and_none_it_still_maps(checkpoint, tmp_path, through_a_link):
    """What a rank's answers carry (`unmapped`), read from its mappings whatever held them, and whatever path
    led to the file (/dev/shm is a link to /run/shm on some systems: the mappings name the file's own)."""
    shared = share(PushedWeights(checkpoint.config, TENSORS))
    assert shared is not None
    if through_a_link:
        os.symlink(weight_transfer.SHM_DIR, tmp_path / "shm")
        shared = dataclasses.replace(shared, path=str(tmp_path / "shm" / os.path.basename(shared.path)))
    try:
        opened = shared.open()
        held = opened.tensors["b"]  # a view of the mapping, alone
        del opened
        assert shared.path not in weight_transfer.unmapped()
        assert torch.equal(held, TENSORS["b"])
        del held
        assert shared.path in weight_transfer.unmapped()
        assert shared.path not in weight_transfer.unmapped()
    finally:
        weight_transfer.remove(os.path.join(weight_transfer.SHM_DIR, os.path.basename(shared.path)))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc on this machine")
def test_a_directory_no_file_can_be_made_in_leaves_the_weights_to_the_messages(checkpoint, monkeypatch):
    monkeypatch.setattr(weight_transfer, "SHM_DIR", "/proc")
    assert shared_buffer(16) is None and share(PushedWeights(checkpoint.config, TENSORS)) is None


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@needs_shm
def test_only_a_file_no_process_holds_is_removed_as_stale():
    """As a server killed while it held pushed weights leaves one. Another live server's file stays, whatever
    its pid means here (a container of its own may share /dev/shm), and so do this process's."""
    left = os.path.join(weight_transfer.SHM_DIR, f"{weight_transfer.PREFIX}left-by-a-killed-server")
    open(left, "wb").close()
    held = os.path.join(weight_transfer.SHM_DIR, f"{weight_transfer.PREFIX}held-by-another-server")
    other = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, held], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert other.stdout.readline() == b"held\n"
        mine = shared_buffer(16)
        assert mine is not None
        ours = shared_files()
        remove_stale()
        assert not os.path.exists(left) and os.path.exists(held) and ours and ours <= shared_files()
    finally:
        other.communicate(b"")
        os.unlink(held)
        weight_transfer.release_kept_files()  # `mine`'s, kept for a later push in this process
