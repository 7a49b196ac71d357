"""The batch lifecycle of one engine step, after TurboMind's `BatchOp`.

    Se -> Rc -> (B -> D) -> St -> (D -> B) -> Rc -> Se

Se: session (history + blocks), Rc: request cache (`Sequence`), B: host batch, D: device tensors,
St: stepping state. Every op runs on the engine loop's thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .model_runner import StepInputs
from ..gateway.request import RequestOutput
from ..sampling.sampler import SampleFuture, SampleResult
from ..scheduling.sequence import Sequence


class BatchOp(enum.Enum):
    kAdd = "add"  # Se -> Rc, host: popped requests become sequences bound to their sessions
    kSetup = "setup"  # Rc -> (B -> D), host to device: token ids, positions, slots, block tables
    kPrepare = "prepare"  # D -> St, device: attention metadata for this step's mix of prefill and decode
    kForward = "forward"  # St -> St, device: model forward over the paged cache, logits of sampling rows
    kUnprep = "unprep"  # St -> D, device: keep only what sampling needs
    kFetch = "fetch"  # D -> B, device to host: sampled token ids and logprobs
    kUpdate = "update"  # B -> Rc, host: append tokens, stop checks, detokenize, emit deltas
    kDel = "del"  # Rc -> Se, host: finished / cancelled sequences leave; blocks freed or kept by the session


@dataclass(slots=True)
class BatchData:
    """One step's batch as it moves through the ops."""

    seqs: list[Sequence]
    samplers: list[Sequence] = field(default_factory=list)  # the sequences that draw a token, in row order
    filled: list[Sequence] = field(default_factory=list)  # those that may have filled a block (`StepPlan.filled`)
    removed: int = 0  # `Scheduler.removed` at launch: a sequence that ended since is still among the samplers
    inputs: StepInputs | None = None
    logits: torch.Tensor | None = None
    draws: SampleFuture | None = None  # queued on the device at launch
    result: SampleResult | None = None  # read from `draws` (kFetch)
    outputs: list[tuple[Sequence, RequestOutput]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
