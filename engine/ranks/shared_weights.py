"""Pushed weights handed to this machine's rank processes through one shared-memory file instead of inside
their messages. Pickled into a message, a model's tensors crossed at 0.09 GB/s (0.54 GB in 6-16 s on the 2-core
EPYC; 2.47 GB in 14-17 s on the H200's machine), ten times slower than the same model saved and loaded from a
checkpoint. Here the serving process writes them once into a file in /dev/shm (memory, not disk), each rank
maps it copy-on-write (a rank that later writes its weights in place gets pages of its own; the others'
stay as they were) and the file is unlinked once every rank has staged them: the ranks' mappings keep its pages
for as long as they serve from them, and the memory goes back with the last of them."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..loading.pushed import PushedWeights, TensorSpec, spec_of, tensor_views

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # tmpfs on Linux


@dataclass(frozen=True, slots=True)
class SharedWeights:
    """What a rank process receives instead of the tensors: the file's path and the tensors packed in it, in
    the specs' order."""

    path: str
    config: ModelConfig
    specs: tuple[TensorSpec, ...]

    def open(self) -> PushedWeights:
        """The tensors, views of a private (copy-on-write) mapping of the file."""
        nbytes = sum(spec.nbytes for spec in self.specs)
        flat = torch.from_file(self.path, shared=False, size=nbytes, dtype=torch.uint8)
        return PushedWeights(self.config, tensor_views(self.specs, flat.numpy().data))


def share(weights: PushedWeights) -> SharedWeights | None:
    """`weights` written into a new file of SHM_DIR, which the caller unlinks once the ranks have read it. None
    where it has no room for them (a container's /dev/shm is often 64 MiB, and a page written past a full tmpfs
    kills the writer: the room is taken first) or there is none: the tensors then travel in the messages."""
    specs = tuple(spec_of(name, t) for name, t in weights.tensors.items())
    nbytes = sum(spec.nbytes for spec in specs)
    if not os.path.isdir(SHM_DIR) or nbytes == 0:
        return None
    fd, path = tempfile.mkstemp(prefix="lmgate-weights-", dir=SHM_DIR)  # readable by this user alone
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        log.warning(
            "no room for %d bytes of weights in %s (%s): sent to the ranks in their messages", nbytes, SHM_DIR, exc
        )
        return None
    os.close(fd)
    try:
        flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        for view, tensor in zip(tensor_views(specs, flat.numpy().data).values(), weights.tensors.values()):
            view.copy_(tensor)
    except BaseException:
        os.unlink(path)
        raise
    return SharedWeights(path, weights.config, specs)
