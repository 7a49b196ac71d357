"""The engine as a Python library: load a model, start the engine loops, submit, stream, cancel."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence, cast

import torch

from .text import chat
from .config import EngineConfig, ModelConfig
from .machine.placement import check_placement
from .ranks.process_ranks import ProcessRanks
from .ranks.ranks import Ranks
from .ranks.thread_ranks import ThreadRanks
from .step.engine_loop import EngineLoop
from .models.tensor_parallel import shard_of
from .errors import ContextOverflow, InvalidRequest, Unavailable, UnsupportedModel
from .gateway.gateway import SLEEP_GATE, Gateway
from .gateway.kv_events import KvEventLog
from .machine.hardware import choose_dtype, cpu_features, matmul_gflops
from .step.kv_cache import auto_kv_cache_tokens, kv_bytes_per_token, kv_cache_dtype
from .loading.loader import Checkpoint, embedded_model_path, load_checkpoint, read_config
from .machine.memory import freeze_startup_heap, keep_freed_memory, release_host_memory, thaw_heap
from .gateway.request import Request, RequestKind, RequestOutput
from .sampling.sampler import SamplingParams
from .machine.threads import available_cpus, on_fresh_thread
from .step.weights import WeightSource, quantized_gguf
from .loading.pushed import TensorSpec, check_specs, pushed_weights
from .loading.weight_group import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT, WeightGroup
from .errors import Aborted, FailedPrecondition

log = logging.getLogger(__name__)

Prompt = str | list[int] | list[chat.Message]  # text, token ids, or chat messages

SLEEP_TAGS = ("weights", "kv_cache")
PAUSE_GATE = "pause"  # closed from a Pause until its Resume
# What a pause does to what runs or is queued: the control request each loop handles it by
PAUSE_MODES = {"abort": RequestKind.ABORT, "wait": RequestKind.AWAIT_IDLE, "keep": RequestKind.FREEZE}
SHAPE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "attention_bias",
    "qk_norm",
)


@dataclass(slots=True)
class EngineInfo:
    model: str
    architecture: str
    max_context_length: int
    vocab_size: int
    engine_loops: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_size: int
    kv_cache_bytes: int
    weights_bytes: int
    sleeping_tags: list[str]
    active_sessions: int
    running_sequences: int
    waiting_sequences: int
    queued_requests: int
    preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    computed_tokens: int
    weight_version: str = "0"
    pause_mode: str | None = None  # of PAUSE_MODES while paused


@dataclass(frozen=True, slots=True)
class PauseResult:
    """What `Engine.pause` did: the requests it aborted or froze, and whether generation was paused already (an
    earlier pause, perhaps another caller's, not yet resumed), which a caller pausing for a span of work leaves
    paused at its end."""

    requests: int
    already_paused: bool


class Stream:
    """The outputs of one request, for a caller on an ordinary thread. Iterating raises the request's error."""

    def __init__(self, engine: "Engine") -> None:
        self._engine = engine
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.request: Request | None = None

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self._queue.get()
            if out.error is not None:
                raise out.error
            yield out
            if out.finished:
                return

    def cancel(self) -> bool:
        assert self.request is not None  # set by Engine.submit before it hands the stream out
        return self._engine.cancel(self.request)


class Engine:
    """The Gateway in front of the data-parallel ranks: `EngineLoop` threads sharing one model, or rank
    processes each with its own (`EngineConfig.dp_backend`); each rank has its own KV cache."""

    def __init__(self, config: EngineConfig | None = None, checkpoint: Checkpoint | None = None) -> None:
        self.config = config = config or EngineConfig()
        keep_freed_memory()
        self.device = torch.device(config.device)
        path = checkpoint.path if checkpoint else config.model or embedded_model_path()
        try:
            quantized = quantized_gguf(config, path, self.device)
            self.dtype, self.dtype_reason = choose_dtype(config.dtype, self.device, quantized_weights=quantized)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if quantized and config.tensor_parallel > 1 and config.dtype == "auto":
            self.dtype_reason += ", as one rank; the shards hold them expanded to float32"
        self._warn_emulated_bf16()
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        processes = config.rank_processes
        if processes:
            check_placement(
                config.device, config.tensor_parallel, config.world_size // config.nnodes, torch.cuda.device_count()
            )
        # self.config: in a lambda, `config` has its parameter's optional type again (to mypy)
        ckpt = checkpoint or on_fresh_thread(lambda: load_checkpoint(self.config.model, weights=not processes))
        self.model_path, self.model_config, self.tokenizer = ckpt.path, ckpt.config, ckpt.tokenizer
        # The ids a request may use: both the tokenizer and the model's embedding must know them.
        self.vocab_size = min(ckpt.tokenizer.vocab_size, ckpt.config.vocab_size)
        self.sleeping: set[str] = (
            set()
        )  # of SLEEP_TAGS, asleep or partly (a Sleep failed on the way); under _admin_lock
        self._slept: set[str] = set()  # of those, the ones whose Sleep completed (a Sleep again leaves them be)
        self._weights_dropped = False  # by a level-2 sleep, until woken; under _admin_lock
        self._admin_lock = threading.Lock()  # serializes sleep / wakeup / update_weights; loops never take it
        self.weight_version = "0"  # the served weights' name (`update_weights`); written under _admin_lock
        self._weight_updates = 0  # completed weight updates: the default name of the next is one more
        # Sleep calls that have closed admission and not yet ended: a Wakeup ending meanwhile must not reopen it.
        self._sleeps_pending = 0
        self.pause_mode: str | None = None  # of PAUSE_MODES while paused; written under _admin_lock
        self._pauses_pending = 0  # Pause calls that have closed admission and not yet ended: as _sleeps_pending
        self._pending_lock = threading.Lock()  # guards _sleeps_pending, _pauses_pending; under _admin_lock or alone
        self._shut_down = False  # set once by `shutdown`; admin calls read it under _admin_lock
        # The trainer's group, joined or being joined (loading/weight_group.py), or None; read and written under
        # _admin_lock, which its join and receives do not hold while they wait on the network.
        self._weight_group: WeightGroup | None = None
        if not config.kv_cache_tokens:
            tokens = auto_kv_cache_tokens(config, ckpt.config, self.dtype, self.kv_dtype)
            self.config = config = dataclasses.replace(config, kv_cache_tokens=tokens)
        self.max_context_length = min(
            config.max_context_length or ckpt.config.max_position_embeddings,
            ckpt.config.max_position_embeddings,
            config.kv_cache_tokens // config.block_size * config.block_size,
        )
        if (config.max_context_length or 0) > self.max_context_length:
            log.warning(
                "max_context_length %d is past what can be served: the context is %d tokens (the model "
                "takes %d, the KV cache holds %d)",
                config.max_context_length,
                self.max_context_length,
                ckpt.config.max_position_embeddings,
                config.kv_cache_tokens,
            )
        self.kv_bytes_per_token = kv_bytes_per_token(ckpt.config, self.kv_dtype)
        # Loops step in parallel: sharing the CPUs beats each loop's pool competing for all of them.
        self.num_threads = config.threads or available_cpus()
        self.threads_per_loop = max(1, self.num_threads * config.nnodes // config.world_size)  # this node's share
        for rank in range(config.tensor_parallel):  # a split the model cannot take is refused before any spawn
            shard_of(ckpt.config, rank, config.tensor_parallel)
        if processes:  # the dtype chosen here for every rank: GPUs of other generations would choose apart
            rank_config = dataclasses.replace(config, dtype=str(self.dtype).removeprefix("torch."))
            self.ranks: Ranks = ProcessRanks(
                rank_config,
                ckpt.path,
                self.max_context_length,
                self.threads_per_loop,
                logging.getLogger().getEffectiveLevel(),
            )
        else:
            self.ranks = ThreadRanks(config, ckpt, self.dtype, self.max_context_length, self.threads_per_loop)
        del ckpt, checkpoint  # the raw weights: the model holds what it needs
        # Loops in rank processes leave text to this process (invariant 13); loops that are threads write it all
        self.gateway = Gateway(queues=self.ranks.queues, tokenizer=self.tokenizer if processes else None)
        try:
            self.ranks.start(self.gateway)
        except BaseException:
            self.gateway.stop_signals()
            raise
        freeze_startup_heap()  # what loading made lives as long as the engine: no full collection walks it

    @property
    def loops(self) -> list[EngineLoop]:
        """The engine loops of this process (none when the ranks are processes)."""
        return getattr(self.ranks, "loops", [])

    @property
    def failure(self) -> str | None:
        """Why a rank died, once one has: the engine then refuses work and the server should exit."""
        return self.ranks.failure

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """`listener(reason)` runs once, on an engine thread, if a rank dies: every stream has then ended
        UNAVAILABLE and new work is refused; the server should exit so that a supervisor restarts it."""
        self.ranks.on_failure(listener)

    def _warn_emulated_bf16(self) -> None:
        """An explicit bf16 on a CPU that only emulates it: say once what it costs here, measured."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or cpu_features().native_bf16:
            return
        fp32, bf16 = on_fresh_thread(lambda: (matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16)))
        log.warning(
            "bfloat16 on %s, which has no bf16 arithmetic in hardware: matmuls measured %.0f GFLOP/s "
            "against %.0f in float32 (%.1fx slower); --dtype auto would choose float32",
            cpu_features().name,
            bf16,
            fp32,
            fp32 / max(bf16, 1e-9),
        )
        self.dtype_reason += f", emulated on this CPU ({fp32 / max(bf16, 1e-9):.1f}x slower matmuls than float32)"

    # requests ----------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, continuation: bool = False) -> list[int]:
        """Token ids of a text, id or chat-messages prompt (messages rendered alone), checked against the
        vocabulary. A text gets the model's special tokens (a BOS), unless it is a `continuation` of earlier
        text (`Tokenizer.encode_continuation`)."""
        if not prompt:  # before encoding: an empty text would still encode to a BOS
            raise InvalidRequest("the prompt is empty")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode_continuation(prompt) if continuation else self.tokenizer.encode(prompt)
        elif chat.is_chat(prompt):
            ids = chat.render_ids(self.tokenizer, cast("list[chat.Message]", prompt))  # is_chat: a list of dicts
        else:
            ids = list(cast("list[int]", prompt))  # neither text nor messages: token ids, as Prompt says
        if not ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        session_id: int = 0,
        request_id: str = "",
        on_output: Callable[[RequestOutput], None] | None = None,
        session_epoch: int | None = None,
        text: bool = True,
    ) -> Stream | Request:
        """Queue a generation. With `on_output`, it runs on the signal thread and the `Request` is returned;
        without, a `Stream` to iterate is returned. Bad input raises here and leaves nothing behind.

        Chat messages in a session are the turn's new messages: the session keeps its conversation and each
        turn renders the whole of it (engine/text/chat.py), in the session's loop, which also answers a template
        that refuses it or a conversation past the context window (alone, a turn of tool results may be refused
        where the conversation is not). A session's text turn continues its context, so only
        its first is encoded as a stateless text prompt is (a BOS; a SentencePiece space). `session_epoch`:
        the copy of the session the caller's history belongs to (else SessionStale); None: any. `text=False`: the
        caller reads token ids only, so no text is written that its stop strings (or chat turn) do not need."""
        params = params or SamplingParams()
        if session_epoch is not None and not session_id:
            raise InvalidRequest("session_epoch names a copy of a session: it needs a session_id")
        # A session's chat turn is rendered with its conversation, by the session's loop (is_chat: a list of dicts)
        messages = cast("list[chat.Message]", prompt) if session_id and chat.is_chat(prompt) else None
        if messages is not None:
            chat.check_turn(self.tokenizer, messages)
            ids = []
        else:
            ids = self.encode_prompt(prompt, continuation=bool(session_id))
        # What a text turn is instead, should it be its session's first: encoded as a stateless prompt is
        first_turn_ids: list[int] = []
        if session_id and isinstance(prompt, str):
            first_turn_ids = self.tokenizer.encode_first_turn(prompt, ids)
        self._check_request(max(ids, first_turn_ids, key=len), params)
        if session_id and (params.n > 1 or params.prompt_logprobs is not None):
            raise InvalidRequest("n > 1 and prompt_logprobs are for stateless requests, not session turns")
        if params.constraint is not None:  # compiled here, off the loop's thread; a bad one refused here
            self.tokenizer.grammars.compile(params.constraint)
        stream: Stream | None = None
        if not on_output:  # the caller iterates a Stream instead
            stream = Stream(self)
            on_output = stream.put
        request = Request(
            RequestKind.GENERATE,
            session_id,
            on_output,
            request_id,
            ids,
            params,
            stateless=not session_id,
            session_epoch=session_epoch,
            text=text,
        )
        request.first_turn_ids = first_turn_ids
        if messages is not None:
            request.messages = [dict(m) for m in messages]
        self.gateway.push(request)
        if stream is None:
            return request
        stream.request = request
        return stream

    def _check_request(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be below the vocabulary size {vocab}")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequest(f"logit_bias token ids must be below the vocabulary size {vocab}")
        if params.n > self.config.max_batch_size:
            raise InvalidRequest(f"n ({params.n}) exceeds the batch's {self.config.max_batch_size} sequences")
        least = max(params.max_new_tokens, params.min_new_tokens)
        if len(ids) + least > self.max_context_length:
            raise ContextOverflow(
                f"{len(ids)} prompt tokens + {least} new tokens exceed the context window of {self.max_context_length} tokens"
            )
        if len(ids) >= self.max_context_length:
            raise ContextOverflow(
                f"{len(ids)} prompt tokens leave no room in the context window of {self.max_context_length} tokens"
            )

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, **kw) -> RequestOutput:
        """Run one request to the end; the merged output (all tokens and text, last finish reason and usage).
        A request of n samples: sample 0's (`generate_samples` has them all)."""
        return self.generate_samples(prompt, params, **kw)[0]

    def generate_samples(self, prompt: Prompt, params: SamplingParams | None = None, **kw) -> list[RequestOutput]:
        """Run one request to the end; each sample's merged output, by index."""
        merged: dict[int, RequestOutput] = {}
        # kw are submit's keywords less on_output (the outputs are read here), so submit returns a Stream
        for out in cast(Stream, self.submit(prompt, params, **kw)):
            into = merged.setdefault(out.index, RequestOutput(out.request_id, out.session_id, index=out.index))
            into.token_ids += out.token_ids
            into.text += out.text
            into.logprobs += out.logprobs
            into.prompt_logprobs = into.prompt_logprobs or out.prompt_logprobs
            into.weight_version = out.weight_version if out.token_ids else into.weight_version  # the last tokens'
            if out.finish_reason is not None:
                into.finish_reason, into.usage = out.finish_reason, out.usage
        return [merged[i] for i in sorted(merged)]

    def cancel(self, request: Request) -> bool:
        return self.gateway.cancel(request)

    def cancel_session(self, session_id: int) -> bool:
        """Cancel the session's active generation; False if it has none. Unknown session: SessionNotFound."""
        request = self.gateway.binding.active(session_id)
        return request is not None and self.gateway.cancel(request)

    # sessions ----------------------------------------------------------------------------------------------

    def start_session(self, session_id: int = 0) -> int:
        return self.gateway.start_session(session_id)

    def session_epoch(self, session_id: int) -> int:
        """Which copy of the session this engine holds (drawn at its start): turns that name another are
        refused with SessionStale."""
        return self.gateway.binding.epoch(session_id)

    def end_session(self, session_id: int, on_done: Callable[[RequestOutput], None] | None = None) -> None:
        """Cancel the session's active generation, free its KV, forget it. Blocks unless `on_done` is given."""
        if on_done is not None:
            self.gateway.kill(session_id, on_done)
            return
        done = threading.Event()
        self.gateway.kill(session_id, lambda _: done.set())
        done.wait()

    def expire_idle_sessions(self, idle_seconds: float, now: float | None = None) -> list[int]:
        """End the sessions that have had no turn for `idle_seconds`, as End would: clients that vanished
        without an End leave nothing behind. The ids ended."""
        return self.gateway.expire_idle(idle_seconds, now)

    # state -------------------------------------------------------------------------------------------------

    def info(self) -> EngineInfo:
        """A snapshot read from other threads without locks: each figure is a single int read, possibly stale."""
        stats = self.ranks.stats()
        return EngineInfo(
            model=self.model_path,
            architecture=self.model_config.architecture,
            max_context_length=self.max_context_length,
            vocab_size=self.vocab_size,
            engine_loops=self.config.engine_loops,
            kv_blocks_total=sum(s.kv_blocks_total for s in stats),
            kv_blocks_free=sum(s.kv_blocks_free for s in stats),
            kv_block_size=self.config.block_size,
            kv_cache_bytes=sum(s.kv_cache_bytes for s in stats),
            weights_bytes=self.weights_bytes,
            sleeping_tags=sorted(self.sleeping),
            active_sessions=len(self.gateway.binding),
            running_sequences=sum(s.running for s in stats),
            waiting_sequences=sum(s.waiting for s in stats),
            queued_requests=sum(s.queued for s in stats),
            preemptions=sum(s.preemptions for s in stats),
            prefix_cache_queried_tokens=sum(s.prefix_queried_tokens for s in stats),
            prefix_cache_hit_tokens=sum(s.prefix_hit_tokens for s in stats),
            computed_tokens=sum(s.computed_tokens for s in stats),
            weight_version=self.weight_version,
            pause_mode=self.pause_mode,
        )

    # sleep and wake-up -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _admin(self) -> Iterator[None]:
        """One admin call at a time, none after shutdown (the ranks it would wait for have gone)."""
        with self._admin_lock:
            if self._shut_down:
                raise Unavailable("the engine has shut down")
            yield

    def sleep(self, level: int) -> None:
        """Close admission, end every stream (CANCELLED) and session, then free memory: level 1 the KV cache
        (weights moved to host memory from an accelerator; on the CPU they stay and do not sleep), level 2 the
        weights too. Returns once the memory is released."""
        if level not in (1, 2):
            raise InvalidRequest(f"sleep level must be 1 or 2, got {level}")
        with self._pending_lock:  # at once, even while another admin call holds the engine
            self._sleeps_pending += 1
            self.gateway.close_admission(SLEEP_GATE, "the engine is asleep: call Admin.Wakeup first")
        try:
            with self._admin():
                # A part counts as asleep before it is put to sleep: one that fails on some rank after others
                # slept is still woken whole by Wakeup, and put to sleep again by the next Sleep (either, done
                # to a part already so, changes nothing).
                parts = [("kv_cache", self._sleep_kv_cache)]
                if level == 2 or self.device.type != "cpu":  # level 1 on the CPU: the weights are in host memory
                    parts.append(("weights", self.ranks.offload_weights))
                for part, put_to_sleep in parts:
                    if part not in self._slept:
                        self.sleeping.add(part)
                        put_to_sleep()
                        self._slept.add(part)
                if level == 2:
                    self._weights_dropped = True  # before: a drop that fails on some ranks still counts
                    self.ranks.drop_weights()
                    self.ranks.release_host_buffers()  # a push's spare buffer too: the sleep is for the memory
                log.info("asleep at level %d", level)
        finally:
            with self._pending_lock:
                self._sleeps_pending -= 1

    def _sleep_kv_cache(self) -> None:
        try:
            self.gateway.control(RequestKind.SLEEP)  # each loop: cancel, end sessions, free its KV
        finally:
            self.gateway.binding.clear()  # a loop that failed to free its KV has ended its sessions too

    def wakeup(self, tags: list[str] | tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
        """Restore the given tags (none: all); admission reopens only once nothing sleeps. Returns what was
        restored (of the tags, what slept) and what still sleeps."""
        unknown = set(tags) - set(SLEEP_TAGS)
        if unknown:
            raise InvalidRequest(f"unknown wake-up tags {sorted(unknown)}; known: {list(SLEEP_TAGS)}")
        with self._admin():
            wanted = set(tags or SLEEP_TAGS) & self.sleeping
            # A part counts as slept no more before it wakes: one that wakes on some ranks only is put to
            # sleep whole again by the next Sleep.
            if "weights" in wanted:
                self._slept.discard("weights")
                self.ranks.restore_weights()
                self._weights_dropped = False
                self.sleeping.discard("weights")
            if "kv_cache" in wanted:
                self._slept.discard("kv_cache")
                self.gateway.control(RequestKind.WAKE_KV)
                self.sleeping.discard("kv_cache")
            with self._pending_lock:
                if not self.sleeping and not self._sleeps_pending:
                    self.gateway.open_admission(SLEEP_GATE)
            log.info("woke %s; still asleep: %s", sorted(wanted), sorted(self.sleeping))
            return sorted(wanted), sorted(self.sleeping)

    # pause and resume --------------------------------------------------------------------------------------

    def pause(self, mode: str, keep_kv: bool = False) -> PauseResult:
        """Stop generation for a weight update: admission closes at once (until `resume`), then every loop, at a
        step boundary, "abort"s what runs or is queued (FinishReason.ABORTED, partial output), lets it finish
        ("wait": returns once it has), or freezes it ("keep"; an update made meanwhile is served to it after
        the resume, its KV recomputed by the new weights unless `keep_kv`). Returns the requests aborted or
        frozen, and whether it was paused already. A pause while paused changes the mode: "wait" lets the frozen
        go on to their end."""
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        kind = RequestKind.FREEZE_KEEP_KV if mode == "keep" and keep_kv else PAUSE_MODES[mode]
        with self._pending_lock:
            self._pauses_pending += 1
            self.gateway.close_admission(PAUSE_GATE, "generation is paused (Admin.Pause): send it after Admin.Resume")
        try:
            with self._admin():
                already_paused = self.pause_mode is not None
                self.pause_mode = mode
                answers = self.gateway.control(kind)
                log.info("paused (%s)", mode)
                return PauseResult(sum(answer.handled for answer in answers), already_paused)
        finally:
            with self._pending_lock:
                self._pauses_pending -= 1

    def resume(self) -> None:
        """End a pause: frozen requests go on (on the weights served now), admission reopens unless the engine
        sleeps or another Pause is on its way. Without a pause, nothing changes."""
        with self._admin():
            if self.pause_mode is not None:
                self.gateway.control(RequestKind.THAW)
                self.pause_mode = None
                log.info("resumed")
            with self._pending_lock:
                if not self._pauses_pending:
                    self.gateway.open_admission(PAUSE_GATE)

    # weights -----------------------------------------------------------------------------------------------

    def update_weights(self, path: str, version: str = "") -> str:
        """Replace the weights with a checkpoint of the same shape, run with its own settings (RoPE, norm eps);
        a mismatch, or a context shorter than the one served, is refused and the old ones stay. Loops pick
        the new model up at their next step; a step in flight finishes on the old one. The tokenizer stays.
        The new weights are served as `version` (empty: the number of updates so far), which is returned."""
        if not path:
            raise InvalidRequest("path is required: a Hugging Face model directory or a .gguf file")
        with self._admin():
            self._check_weights_replaceable()
            new = read_config(path)
            _check_same_shape(new, self.model_config)
            if new.max_position_embeddings < self.max_context_length:
                raise UnsupportedModel(
                    f"checkpoint takes {new.max_position_embeddings} tokens of context, fewer "
                    f"than the {self.max_context_length} served: start a server with it instead"
                )
            version = self._load(path, version)
            self.model_path, self.model_config = path, new
            return version

    def check_weight_specs(self, specs: Sequence[TensorSpec]) -> None:
        """Refuses (InvalidRequest, naming it) a pushed tensor the served model has not, by name, shape or
        dtype, or a set that lacks a weight: what `update_weights_from_tensors` would refuse, asked before the
        bytes are read."""
        check_specs(specs, self.model_config)

    def host_buffer(self, nbytes: int) -> memoryview:
        """Host memory to receive a push's bytes into: where the ranks read them without a copy (a rank
        process maps it), for `update_weights_from_tensors(views of it, owned=True)`."""
        return self.ranks.host_buffer(nbytes)

    def update_weights_from_tensors(
        self, tensors: Mapping[str, torch.Tensor], version: str = "", owned: bool = False
    ) -> str:
        """Replace the weights with `tensors` (every weight of the served model, by Hugging Face name, float32,
        float16 or bfloat16; a tied head may be left out), served in the engine's dtype as `version` (empty:
        the number of updates so far), which is returned. Atomic as `update_weights`; a tensor the model has
        not is refused (InvalidRequest) and nothing changes. A GGUF model's quantized matrices replaced this
        way are served in float. The tensors are copied, so the caller may change its own at once, unless
        `owned` (host tensors that nothing else writes: held as they are)."""
        with self._admin():
            self._check_weights_replaceable()
            pushed = pushed_weights(tensors, self.model_config, owned)
            return self._load(pushed, version)

    def _check_weights_replaceable(self) -> None:
        """Weights asleep at level 2 are replaced by name (Wakeup builds the new ones); offloaded ones are not."""
        if "weights" in self.sleeping and not self._weights_dropped:
            raise Unavailable(
                "the weights are offloaded to host memory (Sleep level 1): call Admin.Wakeup with tag 'weights' "
                "first, or Sleep at level 2 to replace them while asleep"
            )

    def _load(self, source: WeightSource, version: str) -> str:
        """Under `_admin_lock`: every rank serves `source` as `version` (or the next count), or none does."""
        name = version or str(self._weight_updates + 1)
        quiet = self.pause_mode is not None or bool(self.sleeping)  # nothing steps: written in place
        self.ranks.load_weights(source, name, in_place=quiet)
        self._weight_updates += 1
        self.weight_version = name
        self.gateway.control(RequestKind.FLUSH_CACHE)  # every loop has switched (a frozen one too) once answered
        release_host_memory()  # a replaced model not kept as the spare, freed now that no step holds it, goes
        return name

    # weights from a trainer's torch.distributed group -----------------------------------------------------

    def init_weight_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int = 2,
        rank: int = 1,
        backend: str = "gloo",
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        """Join the group whose store the trainer (rank 0) serves at master_address:master_port, at `rank`;
        returns once the group is made. One at a time: FailedPrecondition while one is made or being made. The
        join waits for the trainer without the admin lock, `timeout` seconds at most (DeadlineExceeded)."""
        group = WeightGroup(
            master_address, master_port, world_size, rank, backend, timeout, self.device, self.ranks.host_buffer
        )
        with self._admin():
            if self._weight_group is not None:
                raise FailedPrecondition("a weight group is already made: destroy it first")
            self._weight_group = group
        try:
            group.join()
        except BaseException:
            self._forget_weight_group(group)
            raise
        log.info("joined the weight group at %s:%d as rank %d of %d", master_address, master_port, rank, world_size)

    def update_weights_from_distributed(
        self, specs: Sequence[TensorSpec], version: str = "", bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> str:
        """Receive the tensors `specs` announce from the trainer's broadcast over the group, then serve them as
        `update_weights_from_tensors` does (atomic, every rank), as `version`, which is returned. The specs are
        checked before the trainer is told to send (InvalidRequest: nothing changes, the group stays). The
        receive holds no admin lock; the install takes it. A broadcast that breaks off leaves the old weights
        serving and the group destroyed (Aborted)."""
        with self._admin():
            group = self._weight_group
            if group is None:
                raise FailedPrecondition("no weight group: call InitWeightUpdateGroup first")
            self._check_weights_replaceable()
            check_specs(specs, self.model_config)
        try:
            tensors = group.receive(specs, bucket_bytes)
        except Aborted:
            self._forget_weight_group(group)
            raise
        return self.update_weights_from_tensors(tensors, version, owned=True)  # the receive's own buffer

    def destroy_weight_group(self) -> None:
        """Leave the trainer's group, if there is one (idempotent). A join or receive under way on it ends
        Aborted as its pending collective ends; nothing it received is served."""
        with self._admin_lock:  # after a shutdown too
            group, self._weight_group = self._weight_group, None
        if group is not None:
            group.destroy()
            log.info("left the weight group")

    def _forget_weight_group(self, group: WeightGroup) -> None:
        """`group` failed (and is torn down): the next Init may make another."""
        with self._admin_lock:
            if self._weight_group is group:
                self._weight_group = None

    def flush_prefix_cache(self) -> None:
        """Every loop forgets its prefix cache's keys at its next step boundary (a gateway's FlushCache); blocks
        in use stay in use, and later full blocks are keyed again. Returns once every loop has."""
        with self._admin():
            self.gateway.control(RequestKind.FLUSH_CACHE)

    @property
    def kv_events(self) -> KvEventLog:
        """The prefix cache's block events of every loop, numbered (gateway/kv_events.py); with prefix caching
        off, none ever comes."""
        return self.gateway.kv_events

    @property
    def weights_bytes(self) -> int:
        """Bytes of weights on the engine's device, all ranks together (tied tensors once, packed copies included)."""
        return self.ranks.weights_bytes

    def shutdown(self) -> None:
        """Refuse new work, cancel what runs, join the loops; every stream gets its last output. Then free
        the KV caches and the weights at once, rather than whenever the garbage collector breaks the
        engine's reference cycles."""
        self._shut_down = True
        group = self._weight_group  # read without the admin lock, which a call waiting on the loops may hold
        if group is not None:
            group.destroy()  # a receive under way ends Aborted
        self.gateway.shutdown()
        self.ranks.shutdown()
        self.gateway.stop_signals()  # the last outputs delivered, the loops' last events published
        self.gateway.kv_events.close()  # after those: its readers end
        self.ranks.release_host_buffers()
        thaw_heap()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _check_same_shape(new: ModelConfig, served: ModelConfig) -> None:
    diff = [
        f"{f}: {getattr(new, f)} != {getattr(served, f)}" for f in SHAPE_FIELDS if getattr(new, f) != getattr(served, f)
    ]
    if diff:
        raise UnsupportedModel(f"checkpoint does not match the served model ({'; '.join(diff)})")
