"""How pushed weights reach the rank processes. Pickled as tensors into a message they crossed at 0.09 GB/s
(0.54 GB in 6-16 s on the 2-core EPYC; 2.47 GB in 14-17 s on the H200's machine, ten times slower than the
same model saved and loaded from a checkpoint), and a rank unpickling 2.47 GB on its main thread missed its
heartbeats long enough to be counted dead. So they travel as bytes:

- `SharedWeights`, to this machine's ranks: the bytes in a file of /dev/shm (memory, not disk), which each
  rank maps copy-on-write (a rank that later writes its weights in place gets pages of its own; the others'
  stay as they were). A push is received straight into such a file (`shared_buffer`): no copy at all; other
  tensors are written into a new one (`share`), which the serving process unlinks once every rank has staged
  them (the ranks' mappings keep its pages for as long as they serve from them). A file a push was received
  into is kept for the next push of its size (`_KeptFiles`), once each rank has said it let go of its mapping
  (`unmapped`, in its answers; `released` here).
- `PackedWeights`, to another machine's ranks, or where /dev/shm has no room: the tensors' bytes in one
  `bytearray` inside the message, which pickle copies whole (a rank's main thread unpickles 2.47 GB well
  within its heartbeat), and which the rank's weights thread makes its tensors of (`open`).

A file outlives its serving process only if that process is killed while it holds one: the next server on
the machine removes it (`remove_stale`), as no process holds its lock any more."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import stat
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from ..config import ModelConfig
from ..loading.pushed import PushedWeights, TensorSpec, spec_of, tensor_views

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # tmpfs on Linux
PREFIX = "lmgate-weights-"
ALIGN = 64  # bytes: where each tensor of a new file starts

# This process's files, by path: the descriptor holding each one's lock (a file whose lock no process holds is
# stale). No lock guards it: a buffer's finalizer runs on whatever thread frees it, the garbage collector's
# inside any allocation, and would wait on a lock its own thread holds. So it is touched by single dict
# operations (set, pop, copy), atomic under the GIL.
_files: dict[str, int] = {}
# A rank process's: the files it opened and may still map (`unmapped`), by path: their (device, inode) as
# /proc/self/maps names them. The lock orders opens and reads of them.
_mapped: dict[str, tuple[str, int]] = {}
_mapped_lock = threading.Lock()


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
        with _mapped_lock:
            flat = torch.from_file(self.path, shared=False, size=self.size, dtype=torch.uint8)
            found = os.stat(self.path)
            key = f"{os.major(found.st_dev):02x}:{os.minor(found.st_dev):02x}", found.st_ino
            if key in _mappings():  # else never said to be let go of: the serving process makes new files
                _mapped[self.path] = key
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
    """`nbytes` of host memory in a file of SHM_DIR, to receive a push into: `share` then hands tensors that
    lie in it to the ranks without a copy. A kept file of that size that nothing maps any more (`_KeptFiles`),
    else a new one. Never `release()` the memoryview (as `host_buffer`'s). None where SHM_DIR has no room."""
    return _kept.take(nbytes)


def lend(path: str, ranks: Iterable[int]) -> bool:
    """Whether `path` is a kept file (`shared_buffer`'s), now counted as mapped by `ranks` until each says it
    let go of it (`released`); else the caller removes it once the ranks have read it. Before the ranks open
    it: an answer saying so may come at once."""
    return _kept.lend(path, set(ranks))


def released(paths: Iterable[str], rank: int) -> None:
    """`rank` no longer maps `paths` (its `unmapped`): a push may be received into them again."""
    _kept.released(set(paths), rank)


def awaits_ranks(nbytes: int) -> bool:
    """Whether a kept file of `nbytes` would be free but for a rank that has not said it let go of it: worth
    asking the ranks (`unmapped`) before `shared_buffer` makes a new one."""
    return _kept.awaits_ranks(nbytes)


def release_kept_files() -> None:
    """Let go of the kept files (a level-2 sleep, whose point is memory; shutdown): those nothing maps here
    are removed now, the others when this process's views of them go; the ranks' mappings keep their pages."""
    _kept.clear()


def unmapped() -> list[str]:
    """The files this (rank) process opened (`SharedWeights.open`) that none of its mappings holds any more,
    each named once: the serving process may receive a push into them again. Read from /proc/self/maps, by
    device and inode (whatever path led there), which says so whatever still held them; a file whose mapping
    was not found there when it was opened is never named (the serving process then makes new files)."""
    with _mapped_lock:  # with the opens: a file opened while the maps are read is not taken for gone
        if not _mapped:
            return []
        held = _mappings()
        gone = [path for path, key in _mapped.items() if key not in held]
        for path in gone:
            del _mapped[path]
    return sorted(gone)


def _mappings() -> set[tuple[str, int]]:
    """(device, inode) of every file this process maps; none where /proc cannot say."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            fields = [line.split(maxsplit=5) for line in maps]
        return {(f[3].decode(), int(f[4])) for f in fields if len(f) >= 5}
    except (OSError, ValueError):
        return set()


def share(weights: PushedWeights) -> SharedWeights | None:
    """`weights` in a file of SHM_DIR, which the caller removes (`remove`) once the ranks have read it: the
    shared buffer they were received into, else a new file they are written into. None where it has no room
    for them. Nothing may write the tensors from now on: the ranks' copy-on-write mappings see a write to a
    page they have not written themselves."""
    specs = tuple(spec_of(name, t) for name, t in weights.tensors.items())
    found = _kept.placed(weights.tensors.values())
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


@dataclass(eq=False)
class _Kept:
    """A file pushes are received into: its path, this process's shared mapping of it (pages faulted in; every
    array handed out is a view of it, so it lives while they do), the array last handed out (dead once nothing
    here views it) and the ranks that may map it."""

    path: str
    memory: np.ndarray
    handed: Callable[[], object] = lambda: None
    lent: set[int] = field(default_factory=set)

    @property
    def size(self) -> int:
        return self.memory.size

    def free(self) -> bool:
        return self.handed() is None and not self.lent


class _KeptFiles:
    """The files pushes were received into, kept (linked, locked, mapped here) so that the next push of the same
    size is received into pages already there: on the 2-core EPYC making a new 2.47 GB file took 0.53-0.68 s
    and receiving into it 0.64-0.9 s. A file is free once nothing here views it and every rank it was lent to
    has said it let go of it: their copy-on-write mappings would see the next push's bytes. At most KEPT are
    kept, in use or not, the newest first. A file lives as long as this process's mapping of it
    (`_mapped_file`): one no longer kept is unlinked once nothing here views it (the ranks' mappings keep its
    pages). `_lock` is a leaf held for list operations only."""

    KEPT = 2  # a push's file, and the one before it, mapped by the ranks as their weights' source until replaced

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[_Kept] = []
        self._clears = 0  # how many times `clear` ran: a file taken across one is not kept

    def take(self, nbytes: int) -> memoryview | None:
        with self._lock:
            clears = self._clears
            other_sizes = [k for k in self._kept if k.free() and k.size != nbytes]  # another model's, or dtype's
            found = next((k for k in self._kept if k.free() and k.size == nbytes), None)
            self._kept = [k for k in self._kept if k is not found and k not in other_sizes]
        if found is None:
            found = _mapped_file(nbytes)  # outside the lock: half a second for 2.47 GB
            if found is None:
                return None
        array = found.memory[:]  # the memoryview holds it, and views of that it
        found.handed = weakref.ref(array)
        with self._lock:
            if clears == self._clears:  # else let go of at once, as `clear` let go of the others
                self._kept.insert(0, found)
                del self._kept[self.KEPT :]
        return array.data

    def placed(self, tensors: Iterable[torch.Tensor]) -> tuple[str, int, tuple[int, ...]] | None:
        """The file, its size and each tensor's offset in it, where every tensor is a contiguous host view of
        one kept file that no rank maps yet; else None (a file a rank still maps is not lent again: an answer
        of that rank's, computed before it opened the file anew, could say it let go of it)."""
        with self._lock:
            spans = [(k.memory.ctypes.data, k.size, k.path) for k in self._kept if not k.lent]
        found, offsets = None, []
        for t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous():
                return None
            at = t.data_ptr()
            span = next((s for s in spans if s[0] <= at and at + t.nbytes <= s[0] + s[1]), None)
            if span is None or found not in (None, span):
                return None
            found = span
            offsets.append(at - span[0])
        return None if found is None else (found[2], found[1], tuple(offsets))

    def lend(self, path: str, ranks: set[int]) -> bool:
        with self._lock:
            found = next((k for k in self._kept if k.path == path), None)
            if found is not None:
                found.lent |= ranks
        return found is not None

    def released(self, paths: set[str], rank: int) -> None:
        with self._lock:
            for k in self._kept:
                if k.path in paths:
                    k.lent.discard(rank)

    def awaits_ranks(self, nbytes: int) -> bool:
        with self._lock:
            alike = [k for k in self._kept if k.size == nbytes and k.handed() is None]
        return bool(alike) and not any(k.free() for k in alike)

    def clear(self) -> None:
        with self._lock:
            self._kept = []
            self._clears += 1


def _mapped_file(nbytes: int) -> _Kept | None:
    """A new file, mapped here; removed when the mapping goes (no kept entry, no array handed out over it)."""
    path = _new_file(nbytes)
    if path is None:
        return None
    try:
        memory = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).numpy()
    except RuntimeError as exc:
        remove(path)
        log.warning("mapping %s failed (%s): pushed weights go to the ranks in messages", path, exc)
        return None
    weakref.finalize(memory, remove, path)
    return _Kept(path, memory)


_kept = _KeptFiles()


@atexit.register
def _remove_at_exit(pid: int = os.getpid()) -> None:
    """Every file this process made, kept or not (its mappings do not need the name), rather than leave them to
    the next server's `remove_stale`; a forked child's exit leaves its parent's alone."""
    if os.getpid() == pid:
        for path in list(_files):
            remove(path)
