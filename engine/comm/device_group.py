"""`DeviceGroup`: the tensor-parallel ranks' all-reduce over activations, on torch.distributed (gloo for CPU
tensors, NCCL for CUDA ones: the same code), beside the gloo `GlooComm` that carries their control."""

from __future__ import annotations

import datetime
from typing import Any

import torch
from torch.distributed import PrefixStore, Store
from torch.distributed.distributed_c10d import AllreduceOptions

from .gloo_comm import gloo_group
from .host_comm import CommAborted

TIMEOUT = datetime.timedelta(minutes=10)


class DeviceGroup:
    """Made collectively by the `size` ranks of one tensor-parallel group, each from its own thread; used by
    its loop's thread (leader) or follower thread only, one step at a time."""

    def __init__(
        self, store: Store, prefix: str, rank: int, size: int, device: torch.device, hostname: str = "127.0.0.1"
    ) -> None:
        self.rank, self.size = rank, size
        prefixed = PrefixStore(prefix, store)
        self._group: Any  # a ProcessGroupNCCL or ProcessGroupGloo (torch's stubs give them no collectives)
        if device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL  # only in CUDA builds of torch

            self._group = ProcessGroupNCCL(prefixed, rank, size)  # type: ignore[call-arg]  # stub omits the default options
        else:
            self._group = gloo_group(prefixed, rank, size, TIMEOUT, hostname)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group, in place; a peer gone is `CommAborted`, as for host collectives."""
        tensor = tensor.contiguous()
        try:
            self._group.allreduce([tensor], AllreduceOptions()).wait()
        except RuntimeError as exc:
            raise CommAborted(f"tensor-parallel all-reduce failed: {str(exc).splitlines()[0]}") from exc
        return tensor
