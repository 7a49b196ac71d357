"""Which GPU a rank process computes on.

With `--device cuda` on a machine of several GPUs, its ranks take them in turn: local rank L (its place among
the machine's ranks) on GPU L mod the GPU count, as torchrun's local ranks do. A tensor-parallel group is
consecutive ranks, so as long as it is no larger than the GPU count, its ranks have a GPU each, which NCCL
requires of one communicator. Data-parallel ranks past the GPU count share GPUs. `--device cuda:N` pins
every rank to GPU N, so it cannot serve tensor parallelism.
"""
from __future__ import annotations

import torch

from ..errors import InvalidRequest


def rank_device(device: str, local_rank: int, num_gpus: int) -> torch.device:
    """The device of the machine's `local_rank`-th rank process; anything but a bare `cuda` on several GPUs
    is used as given."""
    configured = torch.device(device)
    if configured.type != "cuda" or configured.index is not None or num_gpus <= 1:
        return configured
    return torch.device("cuda", local_rank % num_gpus)


def check_placement(device: str, tensor_parallel: int, num_gpus: int) -> None:
    """Refuses, before any rank starts, a tensor-parallel group that would put two of its ranks on one GPU."""
    configured = torch.device(device)
    if configured.type != "cuda" or tensor_parallel == 1:
        return
    if configured.index is not None:
        raise InvalidRequest(f"device {device} puts every rank on one GPU, and tensor parallelism needs a GPU per "
                             "rank: use device cuda, whose ranks take the machine's GPUs in turn")
    if tensor_parallel > num_gpus:
        raise InvalidRequest(f"tensor_parallel {tensor_parallel} needs a GPU per rank of its group; this machine "
                             f"has {num_gpus}")
