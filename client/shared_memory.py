"""A file of this machine's shared memory (/dev/shm) that a client writes an update's bytes into, for a server on
the same machine to read instead of receiving them through its socket (`SharedMemoryBytes` in the proto)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import uuid
import weakref
from typing import Iterable

SHM_DIR = "/dev/shm"  # tmpfs on Linux
COPY_BYTES = 32 << 20  # copied with the GIL held (3 ms or so): other threads, an event loop, run between
PREFIX = "lmgate-push-"  # not the server's own "lmgate-weights-", whose stale files a starting server removes
BOOT_ID = "/proc/sys/kernel/random/boot_id"  # a random id each boot: two machines never share one


def shared_memory_id() -> str:
    """This kernel's boot id, SHM_DIR's device and inode, this process's user id: equal to a server's
    `InfoResponse.shared_memory_id` where the server reads this very /dev/shm as this user, so that this
    client's files are the server's to read; "" without SHM_DIR."""
    try:
        with open(BOOT_ID) as f:
            boot = f.read().strip()
        found = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{boot}:{found.st_dev}:{found.st_ino}:{os.getuid()}"


class SharedMemoryFile:
    """One client's file, kept across its updates so that the next one writes into pages already there, through
    a mapping kept as long (2.47 GB: 0.2 s on the 2-core EPYC; `pwrite` into the same pages 0.45, into new ones,
    or through a new mapping, 0.9), readable by this user alone, and removed by `close` (or, left open, when
    the object goes or the interpreter exits; never by a forked child). It is locked while this process holds
    it: a file whose lock no process holds was left by a client that was killed, and the next one made on the
    machine removes it. The caller serializes its use: a write must not begin before the server has read the
    last one (the call that sent it has returned OK or been refused; after any other end, the server may read
    on: make a new file)."""

    def __init__(self) -> None:
        remove_stale()
        fd = -1
        while fd < 0:
            self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
            self.path = os.path.join(SHM_DIR, self.name)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not os.fstat(fd).st_nlink:  # taken for stale between its making and its lock
                os.close(fd)
                fd = -1
        self._fd = fd
        self._length = 0  # the file's, cut to each write's
        self._map: mmap.mmap | None = None  # the whole file, once written; remade when its length changes
        self._view = memoryview(bytearray())
        self._removed = weakref.finalize(self, _remove, fd, self.path, os.getpid())

    def write(self, parts: Iterable[memoryview], length: int, spare: bool = False) -> None:
        """`parts`, `length` bytes in all, back to back from the file's start, over the last write's pages (the
        file cut to that length first). Where /dev/shm has no room (with `spare`: none left after them for as
        many bytes more, as a server whose loops are rank processes receives a push into), OSError before a byte
        is written."""
        if not self._removed.alive:
            raise ValueError(f"{self.path} is closed")
        try:  # the room taken first: a full tmpfs fails this call, not a write half done
            if spare and (room := self._room()) < 2 * length:  # asked first: a failed allocation fills /dev/shm
                raise OSError(errno.ENOSPC, f"{2 * length} bytes asked, {room} free")
            if length > os.fstat(self._fd).st_blocks * 512:  # 0.08 s for 2.47 GB already there: not asked again
                os.posix_fallocate(self._fd, 0, length)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"no room for {length} bytes in {SHM_DIR} ({exc.strerror}): update with shared_memory=False",
            ) from None
        if length != self._length or (length and self._map is None):
            self._unmap()  # before the cut: a mapped page past the file's end is a SIGBUS
            os.ftruncate(self._fd, length)
            self._length = length
            if length:
                self._map = mmap.mmap(self._fd, length)
                self._view = memoryview(self._map)
        at = 0
        for part in parts:
            for start in range(0, len(part), COPY_BYTES):  # the GIL let go between pieces, as pwrite did
                piece = part[start : start + COPY_BYTES]
                self._view[at : at + len(piece)] = piece  # ValueError past `length`
                at += len(piece)
        if at != length:
            raise ValueError(f"{at} bytes written, {length} announced")

    def _room(self) -> int:
        """The bytes this file may hold: SHM_DIR's free ones, and those it holds already."""
        free = os.statvfs(SHM_DIR)
        return free.f_bavail * free.f_frsize + os.fstat(self._fd).st_blocks * 512

    def _unmap(self) -> None:
        self._view.release()
        self._view = memoryview(bytearray())
        if self._map is not None:
            self._map.close()
            self._map = None

    def close(self) -> None:
        self._unmap()
        self._removed()


def remove_stale() -> None:
    """This user's client files in SHM_DIR that no process holds the lock of. A lock, unlike a pid, says so
    across containers that share /dev/shm and through pid reuse. Anything else there by that name (a link, a
    FIFO, another user's file) is left alone, and never waited on."""
    with contextlib.suppress(OSError):
        names = [name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)]
        for path in (os.path.join(SHM_DIR, name) for name in names):
            with contextlib.suppress(OSError):  # locked by a live client (BlockingIOError), or removed meanwhile
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                try:
                    found = os.fstat(fd)
                    if stat.S_ISREG(found.st_mode) and found.st_uid == os.getuid():
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        os.unlink(path)
                finally:
                    os.close(fd)


def _remove(fd: int, path: str, owner: int) -> None:
    if os.getpid() == owner:  # a forked child's copy of the object is not the file's holder
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    os.close(fd)
