"""Host-to-device copies that do not wait for the device.

A plain `.to("cuda")` of a tensor in pageable memory synchronizes its stream: the host would wait for the
step already queued, which is what overlap scheduling (engine_loop.py) must not do. Staged through pinned
memory instead, the copy is queued behind that step; torch's pinned allocator keeps the staging buffer until
the copy has run.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the CPU) on `device`, queued on its current stream without waiting; already there (a CPU
    engine's), as it is, without a torch call (each lets go of the GIL, and the thread waits to take it back)."""
    if tensor.device == device:
        return tensor
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
