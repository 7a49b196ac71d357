"""Giving freed host memory back to the operating system."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc


def release_host_memory() -> None:
    """Collect garbage, then ask glibc to return free heap pages; freed tensors otherwise stay in the
    process's resident set, and a sleeping engine would hold the memory it was asked to give back."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
