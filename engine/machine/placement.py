"""Which GPU a rank process computes on.

With `--device cuda` on a machine of several GPUs, its ranks take them in turn: local rank L (its place among
the machine's ranks) on GPU L mod the GPU count, as torchrun's local ranks do. A tensor-parallel group is
consecutive ranks, so as long as it is no larger than the GPU count, its ranks have a GPU each, which NCCL
requires of one communicator. Data-parallel ranks past the GPU count share GPUs. `--device cuda:N` pins
every rank to GPU N, so it cannot serve tensor parallelism.

Every thread that launches kernels on a rank's GPU makes it its current device first (`use_device`): a new
thread starts on GPU 0, and Triton launches on the current device whatever its tensors' device.
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


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (a bare `cuda` already is: it means the current one)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def check_placement(device: str, tensor_parallel: int, ranks_per_node: int, num_gpus: int) -> None:
    """Refuses, before any rank starts, a tensor-parallel group that would put two of its ranks on one GPU of
    a machine (a group spread over machines puts at most `ranks_per_node` of its ranks on each)."""
    configured = torch.device(device)
    if configured.type != "cuda" or tensor_parallel == 1:
        return
    if configured.index is not None:
        raise InvalidRequest(
            f"device {device} puts every rank on one GPU, and tensor parallelism needs a GPU per "
            "rank: use device cuda, whose ranks take the machine's GPUs in turn"
        )
    on_one_machine = min(tensor_parallel, ranks_per_node)
    if on_one_machine > num_gpus:
        raise InvalidRequest(
            f"tensor_parallel {tensor_parallel} puts {on_one_machine} ranks of a group on each "
            f"machine, each needing a GPU of its own; this machine has {num_gpus}"
        )
