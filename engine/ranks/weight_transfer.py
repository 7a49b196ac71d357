"""How pushed weights reach the rank processes. Pickled as tensors into a message they crossed at 0.09 GB/s
(0.54 GB in 6-16 s on the 2-core EPYC; 2.47 GB in 14-17 s on the H200's machine, ten times slower than the
same model saved and loaded from a checkpoint), and a rank unpickling 2.47 GB on its main thread missed its
heartbeats long enough to be counted dead. So they travel as bytes:

- `SharedWeights`, to this machine's ranks: the bytes in a file of /dev/shm (memory, not disk), which each
  rank maps copy-on-write (a rank that later writes its weights in place gets pages of its own; the others'
  stay as they were). A push is received straight into such a file (`shared_buffer`): no copy at all; other
  tensors are written into a new one (`share`). The serving process unlinks the file once every rank has
  staged them; the ranks' mappings keep its pages for as long as they serve from them.
- `PackedWeights`, to another machine's ranks, or where /dev/shm has no room: the tensors' bytes in one
  `bytearray` inside the message, which pickle copies whole (a rank's main thread unpickles 2.47 GB well
  within its heartbeat), and which the rank's weights thread makes its tensors of (`open`).

A file outlives its serving process only if that process is killed while it holds one: the next server on
the machine removes it (`remove_stale`), as no process holds its lock any more."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
import weakref
from dataclasses import dataclass
from typing import Iterable

import torch

from ..config import ModelConfig
from ..loading.pushed import PushedWeights, TensorSpec, spec_of, tensor_views

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # tmpfs on Linux
PREFIX = "lmgate-weights-"
ALIGN = 64  # bytes: where each tensor of a new file starts

# This process's files, by path: the descriptor holding each one's lock (a file whose lock no process holds is
# stale); and its live shared buffers, by address: (file, size). No lock guards them: a buffer's finalizer runs
# on whatever thread frees it, the garbage collector's inside any allocation, and would wait on a lock its own
# thread holds. So each is touched by single dict operations (set, pop, copy), atomic under the GIL.
_files: dict[str, int] = {}
_buffers: dict[int, tuple[str, int]] = {}


@dataclass(frozen=True, slots=True)
class SharedWeights:
    """Pushed weights in a file of SHM_DIR: its path, its size and where each tensor lies in it."""

    path: str
    size: int
    config: ModelConfig
    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]

    def open(self) -> PushedWeights:
        """The tensors, views of a private (copy-on-write) mapping of the file."""
        flat = torch.from_file(self.path, shared=False, size=self.size, dtype=torch.uint8)
        return PushedWeights(self.config, tensor_views(self.specs, flat.numpy().data, self.offsets))


@dataclass(frozen=True, slots=True)
class PackedWeights:
    """Pushed weights as one run of bytes, the tensors packed in the specs' order."""

    data: bytearray
    config: ModelConfig
    specs: tuple[TensorSpec, ...]

    def open(self) -> PushedWeights:
        """The tensors, views of the bytes (a rank's own: unpickled from its message)."""
        return PushedWeights(self.config, tensor_views(self.specs, self.data))


def shared_buffer(nbytes: int) -> memoryview | None:
    """`nbytes` of host memory in a new file of SHM_DIR, to receive a push into: `share` then hands tensors that
    lie in it to the ranks without a copy. The file is removed when the memory is freed, if `share`'s caller
    has not removed it first. None where SHM_DIR has no room for it."""
    path = _new_file(nbytes)
    if path is None:
        return None
    try:
        flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).numpy()
    except RuntimeError as exc:
        remove(path)
        log.warning("mapping %s failed (%s): pushed weights go to the ranks in messages", path, exc)
        return None
    base = flat.ctypes.data
    _buffers[base] = path, nbytes
    weakref.finalize(flat, _forget, base, path)  # the memoryview holds it, and views of that it
    return flat.data


def share(weights: PushedWeights) -> SharedWeights | None:
    """`weights` in a file of SHM_DIR, which the caller removes (`remove`) once the ranks have read it: the
    shared buffer they were received into, else a new file they are written into. None where it has no room
    for them. Nothing may write the tensors from now on: the ranks' copy-on-write mappings see a write to a
    page they have not written themselves."""
    specs = tuple(spec_of(name, t) for name, t in weights.tensors.items())
    found = _placed(weights.tensors.values())
    if found is not None:
        path, size, offsets = found
        return SharedWeights(path, size, weights.config, specs, offsets)
    offsets, size = _aligned(specs)
    new = _new_file(size)
    if new is None:
        return None
    try:
        flat = torch.from_file(new, shared=True, size=size, dtype=torch.uint8)
        _write(weights, tensor_views(specs, flat.numpy().data, offsets))
    except BaseException:
        remove(new)
        raise
    return SharedWeights(new, size, weights.config, specs, offsets)


def pack(weights: PushedWeights) -> PackedWeights:
    specs = tuple(spec_of(name, t) for name, t in weights.tensors.items())
    data = bytearray(sum(spec.nbytes for spec in specs))
    _write(weights, tensor_views(specs, data))
    return PackedWeights(data, weights.config, specs)


def remove(path: str) -> None:
    """One of this process's files unlinked, its lock let go (once; later calls do nothing). The ranks'
    mappings keep its pages."""
    fd = _files.pop(path, None)
    if fd is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def remove_stale() -> None:
    """The files no process holds the lock of: left by a serving process that was killed while it held them.
    A lock, unlike a pid, says so across containers that share /dev/shm and through pid reuse."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except OSError:
        return
    mine = _files.copy()
    for path in (os.path.join(SHM_DIR, n) for n in names):
        if path in mine:
            continue
        try:  # not a link followed, nor a FIFO waited on
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # another user's, or removed meanwhile
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            log.info("removed %s, left by a server that was killed", path)
        except OSError:
            pass  # held by a live process (BlockingIOError), or removed meanwhile
        finally:
            os.close(fd)


def _new_file(nbytes: int) -> str | None:
    """A new file of `nbytes` in SHM_DIR, locked for as long as this process holds it, its room taken first (a
    container's /dev/shm is often 64 MiB, and a page written past a full tmpfs kills the writer); None where
    there is none."""
    if not os.path.isdir(SHM_DIR) or nbytes == 0:
        return None
    fd = -1
    try:
        while fd < 0:
            fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=SHM_DIR)  # this user's alone
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not os.fstat(fd).st_nlink:  # taken for stale between its making and its lock
                os.close(fd)
                fd = -1
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:  # no room, or no file to be made there
        if fd >= 0:
            os.unlink(path)
            os.close(fd)
        log.warning(
            "no room for %d bytes of weights in %s (%s): they go to the ranks in messages", nbytes, SHM_DIR, exc
        )
        return None
    _files[path] = fd
    return path


def _placed(tensors: Iterable[torch.Tensor]) -> tuple[str, int, tuple[int, ...]] | None:
    """The file, its size and each tensor's offset in it, where every tensor is a contiguous host view of one
    live shared buffer; else None."""
    buffers = _buffers.copy()
    found, offsets = None, []
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        at = t.data_ptr()
        base = next((b for b, (_, size) in buffers.items() if b <= at and at + t.nbytes <= b + size), None)
        if base is None or found not in (None, base):
            return None
        found = base
        offsets.append(at - base)
    if found is None:
        return None
    path, size = buffers[found]
    return path, size, tuple(offsets)


def _aligned(specs: tuple[TensorSpec, ...]) -> tuple[tuple[int, ...], int]:
    """Each tensor's offset, each at a multiple of ALIGN (a model may serve from them as they are), and the size."""
    offsets, at = [], 0
    for spec in specs:
        offsets.append(at)
        at += -(-spec.nbytes // ALIGN) * ALIGN
    return tuple(offsets), at


def _write(weights: PushedWeights, views: dict[str, torch.Tensor]) -> None:
    for name, tensor in weights.tensors.items():
        views[name].copy_(tensor)


def _forget(base: int, path: str) -> None:
    _buffers.pop(base, None)
    remove(path)
