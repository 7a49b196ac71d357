"""`LocalWeights`: the model a process's runners share, and how it sleeps, wakes and is replaced."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import EngineConfig, ModelConfig
from ..kernels import compiler_found, load_cpu_kernels
from ..loading.loader import Checkpoint, load_checkpoint
from ..loading.pushed import PushedWeights
from ..machine.memory import empty_device_cache
from .model_runner import ModelRunner
from ..models import build_model, can_load_in_place, check_fit, count_weight_bytes, expand_blocks, load_in_place
from ..models.llama import LlamaForCausalLM
from ..models.quantized_linear import GGUFBlocks, GGUFStack
from ..models.tensor_parallel import Shard, shard_config, shard_weights
from ..machine.threads import on_fresh_thread

log = logging.getLogger(__name__)

WeightSource = str | PushedWeights  # a checkpoint's path, or weights from a caller's memory


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """A rank's place in its tensor-parallel group: its shard, and the all-reduce over the group."""

    shard: Shard
    all_reduce: Callable[[torch.Tensor], torch.Tensor]


def _blocks_allowed(config: EngineConfig, device: torch.device) -> bool:
    """What `--weights` and the layout ask of quantized blocks, whatever the model: not `float`, the CPU, one
    rank per model."""
    return config.weights != "float" and device.type == "cpu" and config.tensor_parallel == 1


def quantized_gguf(config: EngineConfig, path: str, device: torch.device) -> bool:
    """Whether one rank's `--weights` would keep this model's quantized matrices as blocks, given float32: a
    GGUF file, blocks allowed, a compiler for the kernels. `--dtype auto` then chooses float32
    (hardware.choose_dtype), under tensor parallelism too, where the shards hold the matrices expanded: a model
    split over ranks computes as one rank does (in bfloat16 its greedy tokens would differ). Asked before
    anything is loaded or built, so bad settings are refused first."""
    one_rank = config.weights != "float" and device.type == "cpu"  # `_blocks_allowed` but for the split
    return os.path.isfile(path) and one_rank and compiler_found()  # a file is a GGUF


def keep_quantized(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> bool:
    """`--weights`: a GGUF file's quantized matrices stay quantized where the CPU kernels read them (float32
    activations, no tensor parallelism, a compiler found). `auto` asks for it where it can be had, `quantized`
    says once when it cannot, `float` never asks."""
    if config.weights != "float":
        if _blocks_allowed(config, device) and dtype == torch.float32 and load_cpu_kernels():
            return True
        if config.weights == "quantized":
            log.warning(
                "--weights quantized needs the CPU kernels, float32 and no tensor parallelism: weights are float"
            )
    if config.int8_activations:
        log.warning("--int8-activations needs weights kept quantized (--weights): activations stay float32")
    return False


class LocalWeights:
    """One model, read by every runner of this process (a thread engine's loops, or one rank process).

    Changed only by one admin caller at a time (the Engine's admin lock, a rank's control thread). Weights are
    swapped by replacing the model object and bumping each runner's `weights_version`: a loop reads
    `runner.model` once per step, so a step in flight finishes on the old one. A rank process's new weights
    are only staged by `load`: every rank loads first, and only if all could does each group's leader put its
    group's in, at one step (`install_staged`). A tensor-parallel step that mixed old and new shards would
    compute nothing, and data-parallel ranks on different weights would answer alike requests differently.
    While no step can run (the engine paused or asleep), a float model's new values are written into the
    tensors it serves instead (`load(in_place=True)`; a rank process checks them as it stages them and writes
    them at the install): no second model in memory, no fresh pages to fault in, and the pause a frozen stream
    sees is that much shorter. On the CPU, once updates repeat, the model a serving update replaced is kept,
    and the next serving update writes into it in the same way (`_spare`): no fresh pages, no build.

    New weights come from a `WeightSource`: a checkpoint's path, or `PushedWeights` from a caller's memory.
    Each model carries its `weight_version` (the engine's name for it), which a step's outputs report.
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        dtype: torch.dtype,
        device: torch.device,
        batch_hint: int,
        tp: TensorParallel | None = None,
        quantized: bool = False,
        int8_activations: bool = False,
    ) -> None:
        self.dtype, self.device, self.batch_hint = dtype, device, batch_hint
        self.quantized = quantized and tp is None  # GGUF blocks kept as blocks (`keep_quantized`)
        self.int8_activations = int8_activations and self.quantized  # every step rounds x to int8
        self.path: WeightSource = ckpt.path  # where a dropped model is loaded again from; follows `load`
        self.weight_version = "0"  # the served model's name, the engine's; follows `load`
        self.tp = tp
        # The shapes of every model this process runs (its KV cache's); each is built with its own config
        self.config = self._config_of(ckpt)
        self.runners: list[ModelRunner] = []
        self.model: LlamaForCausalLM | None = self._build(ckpt.config, ckpt.weights, self.weight_version)
        # a rank process's loads by version until installed: what puts them in, the `path` and name they followed
        self._staged: dict[int, tuple[Callable[[], None], WeightSource, str]] = {}
        self._offloaded = False
        # On the CPU, once updates repeat, the model a serving update replaced: the next one writes into it
        self._spare: LlamaForCausalLM | None = None
        self._updated: LlamaForCausalLM | None = None  # the served model, where an update put it in
        self._spared = False  # a spare was kept since the start or the last level-2 sleep (logged once)

    def offload(self) -> None:
        """Sleep level 1: weights kept in host memory, moved off an accelerator, untouched on the CPU."""
        if self.model is not None and self.device.type != "cpu":
            self.model.to("cpu")
            empty_device_cache()
        self._offloaded = True

    def drop(self) -> None:
        """Sleep level 2 (and shutdown): the weights freed; only after every loop has stopped stepping."""
        self._staged.clear()  # `path` names the newest already: a restore loads it
        self._spare, self._spared = None, False
        self._install(None)

    def restore(self) -> None:
        """Undo `offload` or `drop`: back on the device, loaded again from `path` if they were dropped."""
        if self.model is None:
            private = isinstance(self.path, PushedWeights)
            self._install(self._build(*_read(self.path), self.weight_version, private))  # no step runs now
        elif self.device.type != "cpu":
            self.model.to(self.device)
        self._offloaded = False

    def load(self, source: WeightSource, name: str, version: int | None = None, in_place: bool = False) -> None:
        """Replace the weights with a checkpoint's or pushed ones (their shape checked by the caller), served
        as weight version `name`; with a `version` (a rank process), only stage them as that version for
        `install_staged`. Dropped weights (sleep level 2) are only named: `restore` builds them. `in_place`:
        no step runs until the caller says so (a pause, a sleep), so the new values may be written into the
        served model's tensors (`load_in_place`) where they fit it, with no second model built; staged, they
        are checked now and written at the install."""
        if self.model is None:
            if version is not None:  # nothing to put in, but a discard must name the old weights again
                self._staged[version] = lambda: None, self.path, self.weight_version
            self.path, self.weight_version = source, name
            return
        config, weights = _read(source)
        if in_place and self._writable(self.model, config, weights):
            model = self.model
            put_in = functools.partial(self._write, model, self._fitted(model, config, weights), name)
        elif (spare := self._spare) is not None and self._writable(spare, config, weights):
            self._spare = None  # until `_install` makes the model it replaces the spare
            on_fresh_thread(functools.partial(load_in_place, spare, self._fitted(spare, config, weights)))
            spare.weight_version = name
            put_in = functools.partial(self._install, spare, updated=True)
        else:
            self._spare = spare = None  # before the build: its memory is the new model's
            built = self._build(config, weights, name, private=isinstance(source, PushedWeights) and not self._spares)
            put_in = functools.partial(self._install, built, updated=True)
        if version is None:
            put_in()
        else:
            self._staged[version] = put_in, self.path, self.weight_version
        self.path, self.weight_version = source, name

    def install_staged(self, version: int) -> object:
        """Staged `version` in place of the current model, older stages dropped: on the loop or follower
        thread, at the step its group's leader chose (every rank of the group has staged it by then). Returns
        what the stage held of the weights before it (the source they were loaded from), for the caller to let
        go of when it chooses: a lone rank after its answer, as unmapping a pushed 2.47 GB took 0.4-0.5 s."""
        staged = self._staged.pop(version, None)
        for older in [v for v in list(self._staged) if v < version]:  # a copy: the weights thread may stage
            del self._staged[older]
        if staged is not None:
            staged[0]()
        return staged

    def discard_staged(self, version: int) -> None:
        """A staged model the ranks will not switch to (another rank failed to load it): `path` goes back to
        what it named before, or a level-2 sleep's restore would load the discarded checkpoint on this rank
        alone."""
        staged = self._staged.pop(version, None)
        if staged is not None:
            self.path, self.weight_version = staged[1], staged[2]

    @property
    def nbytes(self) -> int:
        """Bytes of weights held on the device (tied tensors once, packed copies included): the served model's,
        and the spare's, which is held as long (until a level-2 sleep)."""
        model, spare = self.model, self._spare  # read once: a rank's "report" may run beside a drop
        if model is None or (self.device.type != "cpu" and self._offloaded):
            return 0
        return count_weight_bytes(model) + (count_weight_bytes(spare) if spare is not None else 0)

    def _config_of(self, ckpt: Checkpoint) -> ModelConfig:
        """The checkpoint's config, as this process's shard of it."""
        return self._shard_of(ckpt.config)

    def _shard_of(self, config: ModelConfig) -> ModelConfig:
        return shard_config(config, self.tp.shard) if self.tp else config

    def _writable(self, model: LlamaForCausalLM | None, config: ModelConfig, weights: dict) -> bool:
        """Whether `weights` would build a model like `model` (the served one, or the spare), so they can be
        written into it: the same config (this rank's shard of it), both float (a GGUF file's blocks kept as
        blocks build quantized layers)."""
        blocks = any(isinstance(w, (GGUFBlocks, GGUFStack)) for w in weights.values())
        return (
            model is not None
            and model.config == self._shard_of(config)
            and can_load_in_place(model)
            and not (blocks and self.quantized)
        )

    def _fitted(self, model: LlamaForCausalLM, config: ModelConfig, weights: dict) -> dict:
        """`weights` as float tensors of this rank's shard, checked to fit `model` before any rank writes a byte;
        expanded off the calling thread, as loading is (engine/machine/threads.py says why)."""

        def fitted() -> dict:
            floats = expand_blocks(weights)
            return shard_weights(floats, config, self.tp.shard) if self.tp else floats

        floats = on_fresh_thread(fitted)
        check_fit(floats, model.config)
        return floats

    @property
    def _spares(self) -> bool:
        """Whether a replaced model is kept as the next update's spare: on the CPU, where the memory is the
        host's and a build into fresh pages costs most of a serving update (the 1B shape on the 2-core EPYC:
        1.9 s in process against 3.0). A model built for a push then owns its memory: a spare that viewed the
        received bytes would hold their buffer from the pushes after (which would each take fresh pages), and
        its next update would write into a source a level-2 sleep's wakeup builds from."""
        return self.device.type == "cpu"

    def _write(self, model: LlamaForCausalLM, weights: dict, name: str) -> None:
        """`weights` (checked to fit) written into `model`, served from now on as version `name`."""
        on_fresh_thread(lambda: load_in_place(model, weights))
        model.weight_version = name
        self._install(model, updated=True)

    def _build(self, full: ModelConfig, weights: dict, name: str, private: bool = False) -> LlamaForCausalLM:
        """Off the calling thread, as loading is: engine/machine/threads.py says why. A tensor-parallel rank builds its
        shard, whose decoder layers sum their row-parallel outputs over the group (so they run as modules). A
        GGUF model's quantized matrix replaced by a pushed float tensor is a float one in `weights`: served so."""
        weights = shard_weights(expand_blocks(weights), full, self.tp.shard) if self.tp else weights
        config = self._shard_of(full)  # its own RoPE, norm eps, tied head
        model = on_fresh_thread(
            lambda: build_model(
                config,
                weights,
                self.dtype,
                self.device,
                self.batch_hint,
                self.quantized,
                self.int8_activations,
                private,
            )
        )
        model.weight_version = name
        if self.tp:
            model.reduce_layers_with(self.tp.all_reduce)
        return model

    def _install(self, model: LlamaForCausalLM | None, updated: bool = False) -> None:
        """`model` served from the next step on (`updated`: put in by an update). Where an update replaces a
        model an update put in (updates repeat, as an RL loop's do; a server updated once keeps one model's
        memory), the replaced one becomes the spare if it can take the next update's values: the engine's
        next update comes after every loop has switched (its FLUSH_CACHE), so no step still reads it then; a
        tensor-parallel follower installs between its steps, on the thread that runs them."""
        replaced, self.model = self.model, model
        for runner in self.runners:
            runner.model = model
            runner.weights_version += 1
        repeated = updated and replaced is self._updated and replaced is not model
        if replaced is not None and repeated and self._spares and _can_be_spare(replaced):
            if not self._spared:
                log.info(
                    "updates repeat: the replaced model (%.2f GB) is kept for the next serving update to write into; "
                    "a level-2 sleep frees it",
                    count_weight_bytes(replaced) / 1e9,
                )
            self._spare, self._spared = replaced, True
        self._updated = model if updated else None


def _can_be_spare(model: LlamaForCausalLM) -> bool:
    """Float tensors of its own, that a later update's values can be written into."""
    return model.owns_memory and can_load_in_place(model)


def _read(source: WeightSource) -> tuple[ModelConfig, dict]:
    """The config and weights by Hugging Face name of a path (loaded off this thread) or of pushed weights."""
    if isinstance(source, PushedWeights):
        return source.config, dict(source.tensors)
    ckpt = on_fresh_thread(lambda: load_checkpoint(source))
    return ckpt.config, ckpt.weights
