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
the machine removes it (`remove_stale`), as its name carries the pid that made it."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Iterable

import torch

from ..config import ModelConfig
from ..loading.pushed import PushedWeights, TensorSpec, spec_of, tensor_views

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # tmpfs on Linux
PREFIX = "lmgate-weights-"

# The live shared buffers of this process, by address: (file, size). Under _LOCK, a leaf.
_buffers: dict[int, tuple[str, int]] = {}
_LOCK = threading.Lock()


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
    lie in it to the ranks without a copy. The file is unlinked when the memory is freed, if `share`'s caller
    has not done so first. None where SHM_DIR has no room for it."""
    path = _new_file(nbytes)
    if path is None:
        return None
    flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).numpy()
    with _LOCK:
        _buffers[flat.ctypes.data] = path, nbytes
    weakref.finalize(flat, _forget, flat.ctypes.data, path)  # the memoryview holds it, and views of that it
    return flat.data


def share(weights: PushedWeights) -> SharedWeights | None:
    """`weights` in a file of SHM_DIR, which the caller unlinks once the ranks have read it: the shared buffer
    they were received into, else a new file they are written into. None where it has no room for them."""
    specs = tuple(spec_of(name, t) for name, t in weights.tensors.items())
    found = _placed(weights.tensors.values())
    if found is not None:
        path, size, offsets = found
        return SharedWeights(path, size, weights.config, specs, offsets)
    size = sum(spec.nbytes for spec in specs)
    new = _new_file(size)
    if new is None:
        return None
    try:
        flat = torch.from_file(new, shared=True, size=size, dtype=torch.uint8)
        _write(weights, specs, flat.numpy().data)
    except BaseException:
        os.unlink(new)
        raise
    return SharedWeights(new, size, weights.config, specs, _packed_offsets(specs))


def pack(weights: PushedWeights) -> PackedWeights:
    specs = tuple(spec_of(name, t) for name, t in weights.tensors.items())
    data = bytearray(sum(spec.nbytes for spec in specs))
    _write(weights, specs, memoryview(data))
    return PackedWeights(data, weights.config, specs)


def remove_stale() -> None:
    """The files of serving processes that have gone (killed while they held one)."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                log.info("removed %s, left by process %s", name, pid)
            except OSError:
                pass  # another user's, or removed meanwhile


def _new_file(nbytes: int) -> str | None:
    """A new file of `nbytes` in SHM_DIR, its room taken first (a container's /dev/shm is often 64 MiB, and a
    page written past a full tmpfs kills the writer); None where there is none."""
    if not os.path.isdir(SHM_DIR) or nbytes == 0:
        return None
    fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=SHM_DIR)  # readable by this user alone
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.unlink(path)
        log.warning(
            "no room for %d bytes of weights in %s (%s): they go to the ranks in messages", nbytes, SHM_DIR, exc
        )
        return None
    finally:
        os.close(fd)
    return path


def _placed(tensors: Iterable[torch.Tensor]) -> tuple[str, int, tuple[int, ...]] | None:
    """The file, its size and each tensor's offset in it, where every tensor is a contiguous host view of one
    live shared buffer; else None."""
    with _LOCK:
        buffers = dict(_buffers)
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


def _packed_offsets(specs: tuple[TensorSpec, ...]) -> tuple[int, ...]:
    offsets, at = [], 0
    for spec in specs:
        offsets.append(at)
        at += spec.nbytes
    return tuple(offsets)


def _write(weights: PushedWeights, specs: tuple[TensorSpec, ...], buffer: memoryview) -> None:
    for view, tensor in zip(tensor_views(specs, buffer).values(), weights.tensors.values()):
        view.copy_(tensor)


def _forget(base: int, path: str) -> None:
    with _LOCK:
        _buffers.pop(base, None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # unlinked once the ranks had read it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
