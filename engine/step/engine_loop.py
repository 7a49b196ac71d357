"""One data-parallel engine loop: continuous batching over its own KV cache, driven by `BatchOp`s."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import repeat

import torch

from ..text import chat
from .batch import BatchData
from ..scheduling.block_manager import BlockManager
from ..text.detokenizer import IncrementalDetokenizer, reply_context
from ..errors import ContextOverflow, EngineError, InternalError, InvalidRequest, SessionBusy, Unavailable
from ..gateway.gateway import SLEEP_GATE, Gateway, Signal, cancelled_output
from ..comm import CommAborted, HostComm
from ..machine.placement import use_device
from ..config import EngineConfig
from .cuda_graphs import DecodeGraphs
from ..kernels import load_cpu_kernels
from ..kernels.triton import available as triton_available
from .block_tables import StepTables
from .kv_cache import allocate_kv_cache, kv_cache_dtype
from .model_runner import ModelRunner
from .plan import PromptRows
from ..gateway.request import CancelFlag, FinishReason, Request, RequestKind, RequestOutput, TokenLogprob, Usage
from ..scheduling.scheduler import Scheduler
from ..scheduling.sequence import EndedTurn, Sequence, Session
from ..text.tokenizer import Tokenizer
from .weights import LocalWeights
from ..sampling.constraints import GrammarMatcher, TokenMasks

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoopStats:
    """One loop's figures for `Engine.info`; read from other threads (or sent by a rank process) without locks,
    each a single int read, possibly stale."""

    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_cache_bytes: int = 0
    running: int = 0
    waiting: int = 0
    queued: int = 0
    preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    steps: int = 0
    pop_seconds: float = 0.0  # in `Gateway.pop`: the ranks' agreement, waits for slower ranks and idle time included
    computed_tokens: int = 0  # KV computed: prompts, recomputations, generated tokens


@dataclass(slots=True)
class TokenRun:
    """Steps that draw for the same sequences in the same order (the same list: `InputBatch`), as kUpdate's
    first step of them found them: whether each draw may be a plain token (no text written here, no grammar),
    and, where so, what the steps' tokens go to, and how many steps from the first none reaches its end."""

    samplers: list[Sequence]
    plain: bool  # False: no step of the run takes the plain path (`EngineLoop._plain_tokens`)
    requests: list[Request]
    indexes: list[int]  # each sample's index
    stop_ids: frozenset[int]  # any sequence's
    slack: int = 0  # steps from the first before one would draw its max_new_tokens-th or reach the context's end
    steps: int = 0  # since the first


def build_runner(weights: LocalWeights, config: EngineConfig, max_context_length: int) -> ModelRunner:
    """A runner over `weights`' model (a tensor-parallel shard's included) with a KV cache of its own."""
    num_blocks = config.kv_cache_tokens // config.block_size
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, weights.dtype, weights.device)
    attention = attention_path(weights.device, config.attention_kernel)
    max_blocks = -(-max_context_length // config.block_size)  # a table at the longest context
    graphs = None
    if config.cuda_graphs and attention == "triton" and config.tensor_parallel == 1:
        graphs = DecodeGraphs(config.max_batch_size, max_blocks, weights.device)
    assert weights.model is not None, "a runner is built over loaded weights"
    runner = ModelRunner(
        weights.model,
        lambda: allocate_kv_cache(weights.config, num_blocks, config.block_size, kv_dtype, weights.device),
        config.block_size,
        weights.device,
        attention,
        StepTables(config.max_batch_size),
        graphs,
    )
    weights.runners.append(runner)
    return runner


def overlap_scheduling(config: EngineConfig, device: torch.device) -> bool:
    """auto: where the device runs a step while the host goes on (CUDA), and no tensor-parallel followers
    need the step's token ids from the host."""
    if config.tensor_parallel > 1:
        return False
    return config.overlap_scheduling == "on" or (config.overlap_scheduling == "auto" and device.type == "cuda")


def attention_path(device: torch.device, kernel: bool) -> str:
    """Triton on CUDA (torch ops without Triton); on the CPU the C++ attention kernels unless they are off or
    could not be built."""
    if device.type == "cuda":
        return "triton" if triton_available() else "torch"
    return "cpu" if kernel and load_cpu_kernels() else "torch"


class EngineLoop:
    """Owns its scheduler, sequences, sessions, block manager and KV cache; runs on its own thread.

    Other threads reach it only through the Gateway (requests in, outputs out).
    """

    def __init__(
        self,
        rank: int,
        gateway: Gateway,
        comm: HostComm,
        runner: ModelRunner,
        blocks: BlockManager,
        tokenizer: Tokenizer,
        max_batch_size: int,
        max_batched_tokens: int,
        max_context_length: int,
        default_max_new_tokens: int,
        num_threads: int,
        overlap: bool = False,
        stream_interval: int = 1,
        text_at_front_end: bool = False,
    ) -> None:
        self.rank = rank
        self.gateway = gateway
        self.comm = comm
        self.runner = runner
        self.blocks = blocks
        self.tokenizer = tokenizer
        self.sessions: dict[int, Session] = {}
        self.scheduler = Scheduler(blocks, self.sessions, max_batch_size, max_batched_tokens)
        self.max_batch_size = max_batch_size
        self.max_context_length = max_context_length
        self.default_max_new_tokens = default_max_new_tokens
        self.num_threads = num_threads  # torch threads for this loop's steps
        self.overlap = overlap  # a step is launched before the previous step's draws are read
        self.stream_interval = stream_interval  # tokens a stream's output gathers before it is sent
        # A loop in a rank process leaves what text it need not read to the serving process's Gateway, which
        # writes it beside this process (`gateway.detokenize`); a thread of that process would only trade its
        # own work for a wait on the GIL.
        self.text_at_front_end = text_at_front_end
        self._inflight: BatchData | None = None  # the launched step whose draws are not read yet (overlap)
        self.num_steps = 0
        self.pop_seconds = 0.0
        self.computed_tokens = 0
        self.weights_version = runner.weights_version  # of the weights the prefix cache's KV was computed with
        self._signals: list[Signal] = []
        self._masks: TokenMasks | None = None  # structured outputs' bitmask, kept across steps (from the first)
        # A pause (KEEP): nothing is scheduled while frozen; an update meanwhile recomputes the KV unless kept
        self.frozen = False
        self.keep_kv_on_update = False
        self._idle_waiters: list[Request] = []  # a pause (WAIT) answered once nothing runs or is queued
        self._cancels_seen = -1  # `CancelFlag.cancels` when this loop last looked for cancelled sequences
        self._token_run: TokenRun | None = None  # kUpdate's run of steps of the same sequences (`_plain_tokens`)

    @classmethod
    def build(
        cls,
        rank: int,
        comm: HostComm,
        gateway: Gateway,
        weights: LocalWeights,
        tokenizer: Tokenizer,
        config: EngineConfig,
        max_context_length: int,
        num_threads: int,
        text_at_front_end: bool = False,
    ) -> "EngineLoop":
        """A loop over `weights`' model with a KV cache of its own (allocated here: call on a fresh thread)."""
        num_blocks = config.kv_cache_tokens // config.block_size
        runner = build_runner(weights, config, max_context_length)
        runner.vocab_size = tokenizer.vocab_size

        return cls(
            rank,
            gateway,
            comm,
            runner,
            BlockManager(num_blocks, config.block_size, config.prefix_caching),
            tokenizer,
            config.max_batch_size,
            config.max_batched_tokens,
            max_context_length,
            config.default_max_new_tokens,
            num_threads,
            overlap_scheduling(config, weights.device),
            config.stream_interval,
            text_at_front_end,
        )

    def stats(self) -> LoopStats:
        return LoopStats(
            self.blocks.num_blocks,
            self.blocks.num_free,
            self.runner.kv_cache_bytes,
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.gateway.own_queue(self.rank).num_generates,
            self.scheduler.num_preemptions,
            self.blocks.queried_tokens,
            self.blocks.hit_tokens,
            self.num_steps,
            self.pop_seconds,
            self.computed_tokens,
        )

    # the loop ----------------------------------------------------------------------------------------------

    def run(self) -> str | None:
        """Until the Gateway shuts down (returns None), or until this loop or a peer fails: then it stops
        the engine and returns why, for its owner to report (`Ranks.failure`)."""
        torch.set_num_threads(self.num_threads)  # also what threads started later take as their default
        failure = None
        try:
            use_device(self.runner.device)  # Triton launches, streams and graphs follow the current device
            self._run()
        except CommAborted:  # a peer rank failed (its thread raised, or its process died): so does this one
            failure = "an engine rank failed"
        except Exception as exc:
            log.exception("engine loop %d failed; stopping the engine", self.rank)
            failure = f"engine loop {self.rank} failed: {exc}"
            self.comm.abort()  # release the peers from their collectives
        if failure is not None:  # what this loop holds or has queued ends with the failure, not as cancelled
            error = Unavailable(f"{failure}; the server is stopping")
            self._fail_all(error)
            self.gateway.shutdown(error)
        self._cancel_all()
        for waiter in self._idle_waiters:  # the pause that waits is told the engine stopped
            self._emit(waiter, RequestOutput("", 0, finish_reason=FinishReason.CANCELLED))
        self._flush()
        return failure

    def _run(self) -> None:
        while True:
            free = self.max_batch_size - len(self.scheduler.running) - len(self.scheduler.waiting)
            if self.frozen:  # everything queued joins the frozen (it runs after the pause), none spins in the queue
                free = self.gateway.own_queue(self.rank).num_generates
            start = time.perf_counter()
            requests = self.gateway.pop(self.rank, max(free, 0), self._has_work, self.comm)
            self.pop_seconds += time.perf_counter() - start
            if requests is None:
                self._drain()
                return
            try:
                self.step(requests)
            except CommAborted:  # a tensor-parallel peer failed mid-step: as a data-parallel one would
                raise
            except Exception as exc:  # a failed step must end its streams, not hang them
                self._step_failed(exc)
                if self.runner.followers is not None:
                    raise  # its followers may be inside that step's collectives: the group must break
            self._answer_idle_waiters()
            self._flush()

    def _has_work(self) -> bool:
        """Whether to step (asked again whenever the loops wake): a launched step to read, or sequences to run;
        frozen ones only once one of them is cancelled."""
        if self._inflight is not None:
            return True
        if not self.frozen:
            return self.scheduler.has_work
        return self.gateway.has_stops(self.rank) or any(
            s.request.cancel_flag.value == CancelFlag.CANCELLED
            for s in self.scheduler.running + list(self.scheduler.waiting)
        )

    def _step_failed(self, exc: Exception) -> None:
        log.exception("engine loop %d: step failed", self.rank)
        self._settle_device()
        self._fail_all(InternalError(f"engine step failed: {exc}"))

    def _settle_device(self) -> None:
        """Wait for what a failed step queued on the device: its copies read pinned host buffers (the graphs'
        inputs and table rows) that the next steps write again, an order that reading each step's draws gives
        otherwise, and a failed step's draws are never read."""
        if self.runner.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.runner.device)
        except Exception:  # a device in error runs nothing more: its queued copies read nothing
            log.exception("engine loop %d: the device failed too", self.rank)

    def step(self, requests: list[Request]) -> None:
        """One engine step: kAdd, cancellations, then the batch ops kSetup .. kDel.

        With overlap, the step's batch goes to the device (kSetup .. kForward, sampling queued) before the
        previous step's draws are read (kFetch .. kDel): the host's work for one step runs while the device
        computes the next. A decode whose token is still on the device takes it from there; a sequence that
        ended at the previous step may have run once more, and that token is dropped unread."""
        self.num_steps += 1
        self._add_all(requests)
        self._switch_weights()
        self._reap_cancelled()
        if self._inflight is not None and any(s.params.penalized for s in self._inflight.samplers):
            self._drain()  # penalties read the ids of every token drawn so far
        batch = BatchData(self.scheduler.schedule() if not self.frozen else [])
        previous, self._inflight = self._inflight, None
        if batch.seqs:
            self._launch(batch, previous)
            self._inflight = batch
        if previous is not None:
            self._complete(previous)
        if not self.overlap:
            self._drain()

    def _switch_weights(self) -> None:
        """At a step boundary: staged weights go in. Once the weights changed, the prefix cache is emptied (its
        KV was computed by other weights), and what holds KV keeps it unshared, or, frozen by a pause, has it
        recomputed by the new weights (`keep_kv_on_update` keeps it)."""
        self.runner.install_pending_weights()
        if self.weights_version == self.runner.weights_version:
            return
        self._drain()  # the launched step's blocks, computed by the old weights, are keyed before the reset
        self.blocks.reset_prefix_cache()
        if self.frozen and not self.keep_kv_on_update:
            self._recompute_all()
        for holder in [*self.sessions.values(), *self.scheduler.running, *self.scheduler.waiting]:
            holder.keyable = not holder.block_table  # KV of the old weights is kept, never shared
        self.weights_version = self.runner.weights_version

    def _recompute_all(self) -> None:
        """Every sequence and idle session gives its KV back: their tokens are computed again when they next run.
        A request that asked to keep its KV across updates (`keep_kv_on_update`) keeps it."""
        for seq in reversed(self.scheduler.running):
            if not seq.params.keep_kv_on_update:
                self.scheduler.requeue(seq)
        for holder in [*self.scheduler.waiting, *self.sessions.values()]:
            if not (isinstance(holder, Sequence) and holder.params.keep_kv_on_update):
                self.blocks.release(holder.block_table)
                holder.drop_kv()

    def _launch(self, batch: BatchData, previous: BatchData | None) -> None:
        """kSetup .. kForward, and sampling queued on the device: returns without waiting for it. A request's
        first sample forks the others as it draws its first token; the plan moves every sequence past the step."""
        if self.scheduler.unforked:
            for seq in batch.seqs:
                if seq.samples is not None and seq.samples.to_fork and seq.samples_this_step:
                    self.scheduler.fork(seq)
        drawn = previous.draws.tokens if previous is not None and previous.draws is not None else None
        copies = [(source, copy) for copy, source in self.scheduler.copies.items()]
        decodes_only = self.scheduler.decodes_only
        plan, batch.inputs = self.runner.setup(batch.seqs, drawn, copies, decodes_only)  # kSetup + kPrepare
        batch.samplers, batch.filled, batch.removed = plan.samplers, plan.filled, self.scheduler.removed
        self.computed_tokens += len(plan.input_ids)
        batch.logits = logits = self.runner.forward(batch.inputs)  # kForward + kUnprep
        assert logits is not None, "a loop's runner computes the logits"
        batch.draws = self.runner.sample(logits, batch.inputs, self._token_masks(plan.constrained))

    def _token_masks(self, constrained: list[tuple[int, GrammarMatcher]]) -> tuple[torch.Tensor, list[int]] | None:
        """The constrained rows' masks (structured outputs), filled on the host while the device computes the
        forward just queued; None where no row is constrained. `constrained`: (row, its matcher) each."""
        if not constrained:
            return None
        if self._masks is None:
            self._masks = TokenMasks(self.tokenizer.grammars.vocab_size, threads=self.num_threads)
        return self._masks.fill([matcher for _, matcher in constrained]), [row for row, _ in constrained]

    def _complete(self, batch: BatchData) -> None:
        """kFetch (waits for the device) .. kDel of a launched step."""
        assert batch.draws is not None and batch.inputs is not None, "a launched step"
        batch.result = batch.draws.result()
        if batch.inputs.prompt is not None:
            self._add_prompt_logprobs(batch.inputs.prompt)
        filled = [s for s in batch.filled if s.finish_reason is None]  # one ended since has handed its blocks back
        self._update(batch.samplers, batch)
        # With those that end now: the step launched after this one (overlap) may have filled a block of theirs.
        self.blocks.cache_full_blocks(filled + batch.finished)
        for seq in batch.finished:
            self._del(seq)

    def _add_prompt_logprobs(self, prompt: PromptRows) -> None:
        """The step's prompt log-probabilities, to the sequences that asked; sent with their first output."""
        assert prompt.result is not None, "computed by the step's forward"
        values = prompt.result.tolist()
        at = 0
        for seq, count in prompt.owners:
            k, collected = seq.params.prompt_logprobs or 0, seq.prompt_logprobs
            assert collected is not None, "only a sequence that asked has prompt rows"
            for row, target in zip(values[at : at + count], prompt.targets[at : at + count]):
                top = [(int(t), v) for t, v in zip(row[1 : 1 + k], row[1 + prompt.top : 1 + prompt.top + k])]
                collected.append(TokenLogprob(target, row[0], top))
            at += count

    def _drain(self) -> None:
        """Read the launched step's draws, if any: the host's state is then whole."""
        batch, self._inflight = self._inflight, None
        if batch is not None:
            self._complete(batch)

    # kAdd --------------------------------------------------------------------------------------------------

    def _add_all(self, requests: list[Request]) -> None:
        """kAdd of the requests taken, once the stop strings the front end found before they came are applied:
        a session's next turn goes on from where its last one stopped."""
        if self.gateway.has_stops(self.rank):
            self._end_at_stop_strings()
        for request in requests:
            self._add(request)

    def _add(self, request: Request) -> None:
        """Hand a popped request to the scheduler, or answer it, whatever fails: the Gateway counts it as taken,
        so a request dropped here would hang its stream, its End, or the Sleep or Wakeup waiting on it."""
        try:
            if request.kind is RequestKind.GENERATE:
                self._add_generate(request)
            else:
                self._control(request)
        except CommAborted:
            raise
        except Exception as exc:
            log.exception("engine loop %d: a %s request failed", self.rank, request.kind.name)
            error = exc if isinstance(exc, EngineError) else InternalError(f"{request.kind.name.lower()} failed: {exc}")
            self._emit(request, RequestOutput(request.request_id, request.session_id, error=error))

    def _add_generate(self, request: Request) -> None:
        if self._ended_while_queued(request):
            self._emit(request, cancelled_output(request))
            return
        session = (
            Session(0)
            if request.stateless
            else self.sessions.setdefault(request.session_id, Session(request.session_id))
        )
        if session.active is not None and session.active.request.cancel_flag.value == CancelFlag.CANCELLED:
            self._finish(session.active, FinishReason.CANCELLED)  # a cancelled turn the next one overtook: as
            self._del(session.active)  # `_reap_cancelled` would end it, so that its history leads into this one
        if session.active is not None:
            self._emit(
                request,
                RequestOutput(
                    request.request_id,
                    request.session_id,
                    error=SessionBusy(f"session {request.session_id} is already generating"),
                ),
            )
            return
        if not session.token_ids and request.first_turn_ids:  # a first text turn, as a stateless prompt
            request.input_ids = request.first_turn_ids
        try:
            keep, conversation = len(session.token_ids), None
            if request.messages is not None:
                keep, conversation = self._chat_turn(session, request)
            max_new = self._max_new_tokens(request, keep + len(request.input_ids))
        except EngineError as exc:
            self._emit(request, RequestOutput(request.request_id, request.session_id, error=exc))
            return
        grammar = None
        if request.params.constraint is not None:  # compiled where it was submitted: found in the cache
            grammars = self.tokenizer.grammars
            grammar = grammars.cached(request.params.constraint) or grammars.compile(request.params.constraint)
        self._truncate_history(session, keep)
        skip = request.params.skip_special_tokens
        # This loop writes the text where the caller reads it, it stops on a string or the session keeps the chat
        # turn, and the caller is in this process. A loop in a rank process leaves the text and the stop strings
        # to the front end (`text_context`, `Gateway.stop_found`), and decodes a chat turn's reply once, at its
        # end (`_reply_text`).
        front_reads = request.text or bool(request.params.stop)  # what the front end writes, where it does
        writes_text = (front_reads or conversation is not None) and not self.text_at_front_end
        detok: IncrementalDetokenizer | None = None
        context: list[int] | None = None
        if front_reads or conversation is not None:
            context = reply_context(self.tokenizer, session.token_ids + request.input_ids, skip)
            if writes_text:
                detok = IncrementalDetokenizer(self.tokenizer, skip, request.params.stop, context=context)
        seq = Sequence(request, session, detok, max_new, self.tokenizer.eos_token_ids)
        seq.text_context = context if front_reads and not writes_text else None
        seq.conversation = conversation
        if conversation is not None and not writes_text:
            seq.reply_context = context
        if grammar is not None:
            seq.grammar, seq.matcher = grammar, grammar.matcher()
        session.drop_kv()  # the sequence holds the blocks until kDel
        session.active = seq
        self.scheduler.add(seq)

    def _chat_turn(self, session: Session, request: Request) -> tuple[int, list[dict]]:
        """Render the whole conversation; the turn's input is what follows the longest prefix the session
        holds (at least one token). Returns that prefix's length and the conversation."""
        if session.messages is None:
            raise InvalidRequest(
                f"session {session.session_id} holds prompt or token turns; messages continue "
                "only a session whose every turn is messages"
            )
        assert request.messages is not None, "a turn of messages"
        conversation = session.messages + request.messages
        ids = chat.render_ids(self.tokenizer, conversation)
        keep = min(chat.common_prefix(session.token_ids, ids), len(ids) - 1)
        request.input_ids = ids[keep:]
        return keep, conversation

    def _truncate_history(self, session: Session, num_tokens: int) -> None:
        """Forget the session's tokens past `num_tokens`, and the KV blocks that held only those."""
        if num_tokens >= len(session.token_ids):
            return
        bs = self.blocks.block_size
        session.token_ids = session.token_ids[:num_tokens]
        keep = min(session.num_computed, num_tokens)
        kept = self.blocks.blocks_for(keep)
        if keep % bs and not self.blocks.make_private(session.block_table[kept - 1]):
            kept, keep = kept - 1, (kept - 1) * bs  # a shared block is never written again: recompute its part
        self.blocks.release(session.block_table[kept:])
        session.block_table, session.block_hashes = session.block_table[:kept], session.block_hashes[: keep // bs]
        session.num_computed = keep
        session.keyable = session.keyable or not kept  # no KV of replaced weights is left

    def _ended_while_queued(self, request: Request) -> bool:
        """Work queued before a sleep closed admission, or whose session ended meanwhile. (Work queued before a
        server's shutdown runs in its grace period.) A rank in a process of its own has no gates: there a sleep
        that overtook a queued turn shows as the KV cache gone."""
        if self.gateway.gate_closed(SLEEP_GATE) or not self.runner.kv_caches:
            return True
        return not request.stateless and self.gateway.binding.find(request.session_id) != self.rank

    def _control(self, request: Request) -> None:
        try:
            self._drain()  # a session's end, a sleep or a wakeup sees every token drawn so far
        except Exception as exc:  # that step's failure is the step's, not this request's
            self._step_failed(exc)
        if request.kind is RequestKind.KILL:
            self._kill(request)
            return
        handled = 0
        if request.kind is RequestKind.SLEEP:
            self._cancel_all()
            self.blocks.reset_prefix_cache()
            self.runner.release_kv_cache()
        elif request.kind is RequestKind.WAKE_KV:
            self.runner.allocate_kv_cache()
        elif request.kind is RequestKind.FLUSH_CACHE:
            self._switch_weights()  # after an update: the loop serves the new weights once this is answered
            self.blocks.reset_prefix_cache()  # its KV stays right: what holds blocks goes on with them
        elif request.kind is RequestKind.ABORT:
            handled = self._abort_all()
        elif request.kind in (RequestKind.FREEZE, RequestKind.FREEZE_KEEP_KV):
            self.frozen, self.keep_kv_on_update = True, request.kind is RequestKind.FREEZE_KEEP_KV
            handled = len({id(s.request) for s in self.scheduler.running + list(self.scheduler.waiting)})
        elif request.kind is RequestKind.THAW:
            self._switch_weights()  # an update made while frozen, before anything runs again
            self.frozen = False
        elif request.kind is RequestKind.AWAIT_IDLE:
            self.frozen = False  # what a pause froze goes on to its end
            self._idle_waiters.append(request)
            return
        self._emit(request, RequestOutput("", 0, finish_reason=FinishReason.STOP, handled=handled))

    def _abort_all(self) -> int:
        """End every sequence, and every generate still queued, with their partial output: the requests ended."""
        self._add_all(self.gateway.take_queued(self.rank))
        seqs = self.scheduler.running + list(self.scheduler.waiting)
        for seq in seqs:
            if seq.finish_reason is None:
                self._finish(seq, FinishReason.ABORTED)
            self._del(seq)
        return len({id(s.request) for s in seqs})

    def _answer_idle_waiters(self) -> None:
        """A pause that waits hears once nothing of this loop runs or is queued."""
        if not self._idle_waiters or self.scheduler.has_work or self._inflight is not None:
            return
        if self.gateway.own_queue(self.rank).num_generates:
            return
        for waiter in self._idle_waiters:
            self._emit(waiter, RequestOutput("", 0, finish_reason=FinishReason.STOP))
        self._idle_waiters = []

    def _max_new_tokens(self, request: Request, prompt_len: int) -> int:
        """The turn's most new tokens: as asked, else the default, raised to min_new_tokens; within the context."""
        room = self.max_context_length - prompt_len
        asked = request.params.max_new_tokens
        least = max(asked, request.params.min_new_tokens)
        if room <= 0 or least > room:
            need = f"{prompt_len} prompt tokens" + (f" + {least} new tokens" if least else "")
            raise ContextOverflow(f"{need} exceed the context window of {self.max_context_length} tokens")
        return asked or min(max(self.default_max_new_tokens, least), room)

    def _kill(self, request: Request) -> None:
        session = self.sessions.pop(request.session_id, None)
        if session is not None:
            if session.active is not None:
                self._finish(session.active, FinishReason.CANCELLED)
                self._del(session.active)
            self.blocks.release(session.block_table)
            session.drop_kv()
        self._emit(request, RequestOutput("", request.session_id, finish_reason=FinishReason.STOP))

    def _reap_cancelled(self) -> None:
        """End the sequences whose requests were cancelled: looked for only once a flag has flipped since the
        last look (`CancelFlag.cancels`, read before looking, so a flip during the look is seen next step)."""
        cancels = CancelFlag.cancels()
        if cancels == self._cancels_seen:
            return
        self._cancels_seen = cancels
        for seq in self.scheduler.running + list(self.scheduler.waiting):
            if seq.request.cancel_flag.value == CancelFlag.CANCELLED:
                self._finish(seq, FinishReason.CANCELLED)
                self._del(seq)

    def _end_at_stop_strings(self) -> None:
        """End the samples whose stop string the front end found (`Gateway.stop_found`) after the tokens it
        kept, as this loop would have stopped them there: one still running ends STOP (its tokens past the
        stop string unsent: the front end drops them), and a session's history ends at the stop string, though
        this loop had ended the turn further on. The front end told the client the end already: the usage the
        output carries is its own."""
        live = self.scheduler.running + list(self.scheduler.waiting)
        for found in self.gateway.take_stops(self.rank):
            seq = next((s for s in live if s.request is found.request and s.index == found.index), None)
            if seq is not None and seq.finish_reason is None:
                seq.unsent = None
                self._finish(seq, FinishReason.STOP)
                self._del(seq)
            session = self.sessions.get(found.session_id) if found.session_id else None
            turn = session.last_turn if session is not None and session.active is None else None
            if session is None or turn is None or turn.request is not found.request:
                continue  # stateless, ended, or a later turn has come (a cancelled one's next)
            self._truncate_history(session, turn.num_prompt + found.num_output)

    # kUpdate -----------------------------------------------------------------------------------------------

    def _update(self, samplers: list[Sequence], batch: BatchData) -> None:
        """A token per sampling row: hundreds a step on the host's critical path. The common case (a token
        sent at once, its ids alone: no logprobs, no text written here, no grammar, neither the first nor the
        last) leaves as a token delta (`Signal`), of which the signal thread makes the output: for a whole step
        at once where every row's is (`_plain_tokens`), else row by row, where a token whose text this loop
        writes, with no stop string to hold it back, leaves as a delta with its text."""
        if not self._plain_tokens(samplers, batch):
            self._update_rows(samplers, batch)

    def _plain_tokens(self, samplers: list[Sequence], batch: BatchData) -> bool:
        """Where every token of the step is plain (`_update_rows`' common case): each appended, its draw no
        longer pending, and the step's token deltas made in one pass. The rows' own tests are made once, at the
        first of a run of steps of the same rows (`TokenRun`); each step tests what it alone can change: no
        sequence has ended since it was launched, none asked for logprobs, no token is a stop id, and the run
        has not reached the step at which one would draw its last token or fill the context."""
        result = batch.result
        assert result is not None, "read by kFetch"
        run = self._token_run
        if run is None or run.samplers is not samplers:
            run = self._token_run = self._first_of_run(samplers)
        else:
            run.steps += 1
        if (
            run is None
            or not run.plain
            or run.slack <= run.steps
            or batch.removed != self.scheduler.removed
            or any(result.logprobs)
            or not run.stop_ids.isdisjoint(result.token_ids)
        ):
            return False
        tokens = result.token_ids
        for seq, token in zip(samplers, tokens):
            seq.num_pending -= 1
            seq.token_ids.append(token)
        version = batch.inputs.weight_version if batch.inputs is not None else ""
        self._signals.extend(zip(run.requests, tokens, run.indexes, repeat(version)))
        return True

    def _first_of_run(self, samplers: list[Sequence]) -> TokenRun | None:
        """What the first step of a run of `samplers` finds of them, before its tokens are appended. A run of
        rows that write text here or follow a grammar, or a stream interval over one, never takes the plain
        path; None where this step holds a first token or an output not sent yet: its next step looks again."""
        plain = self.stream_interval == 1 and all(s.detokenizer is None and s.matcher is None for s in samplers)
        run = TokenRun(samplers, plain, [], [], frozenset())
        if not plain:
            return run
        limit, slack = self.max_context_length, self.max_context_length
        for s in samplers:
            num_tokens = len(s.token_ids) + 1  # with this step's token
            num_output = num_tokens - s.num_prompt_tokens
            if num_output < 2 or s.unsent is not None:
                return None
            slack = min(slack, s.max_new_tokens - num_output, limit - num_tokens)
        run.requests = [s.request for s in samplers]
        run.indexes = [s.index for s in samplers]
        run.stop_ids = frozenset().union(*(s.stop_ids for s in samplers))
        run.slack = slack
        return run

    def _update_rows(self, samplers: list[Sequence], batch: BatchData) -> None:
        """kUpdate row by row (`_update`)."""
        interval, limit = self.stream_interval, self.max_context_length
        signal = self._signals.append  # `_emit`, without a call of its own per token
        version = batch.inputs.weight_version if batch.inputs is not None else ""
        result = batch.result
        assert result is not None, "read by kFetch"
        for seq, token, lp in zip(samplers, result.token_ids, result.logprobs):
            seq.num_pending -= 1
            if seq.finish_reason is not None:  # ended (or cancelled) after this step was launched
                continue
            token_ids = seq.token_ids
            token_ids.append(token)
            num_tokens = len(token_ids)
            num_output = num_tokens - seq.num_prompt_tokens  # `Sequence.num_output`
            detok = seq.detokenizer
            if (
                interval == 1
                and lp is None
                and seq.unsent is None
                and seq.matcher is None
                and 1 < num_output < seq.max_new_tokens
                and num_tokens < limit
                and token not in seq.stop_ids
            ):
                if detok is None:
                    signal((seq.request, token, seq.index, version))
                    continue
                if not detok.has_stops:  # its text, all of it, goes with the token
                    signal((seq.request, token, seq.index, version, detok.step_one(token)[0]))
                    continue
            out = seq.unsent or self._unsent(seq)
            if out.weight_version != version:  # the tokens of other weights go first, in an output of their own
                if out.token_ids:
                    seq.unsent = None
                    signal((seq.request, out))
                    out = self._unsent(seq)
                out.weight_version = version
            out.token_ids.append(token)
            if lp is not None:
                out.logprobs.append(TokenLogprob(token, lp[0], lp[1]))
            reason, stop_hit = None, False
            if token in seq.stop_ids:
                reason = FinishReason.STOP
            else:
                if detok is not None:  # else the front end writes the text
                    text, stop_hit = detok.step_one(token)
                    out.text += text
                if stop_hit:
                    reason = FinishReason.STOP
                elif num_output >= seq.max_new_tokens or num_tokens >= limit:
                    reason = FinishReason.LENGTH
            if seq.matcher is not None and reason is None and self._grammar_ended(seq, token):
                reason = FinishReason.STOP
            if reason is not None:
                if detok is not None and not stop_hit:
                    out.text += detok.finish()
                    if detok.stopped:  # a stop string that only the final decode revealed
                        reason = FinishReason.STOP
                seq.finish_reason = out.finish_reason = reason
                out.usage = self._usage(seq)
                if detok is not None:
                    out.stop_string = detok.stop_string
                if seq.samples is not None:
                    out.others_running = seq.samples.end_one()
                batch.finished.append(seq)
            if reason is not None or num_output == 1 or len(out.token_ids) >= interval:
                seq.unsent = None  # the first token at once, for its latency; the last with its reason
                signal((seq.request, out))

    def _grammar_ended(self, seq: Sequence, token: int) -> bool:
        """Advance a constrained sequence's matcher; True where its grammar lets nothing but an end follow (the
        output is whole), or refused the token (a row that could draw nothing the mask allowed)."""
        matcher = seq.matcher
        assert matcher is not None, "a constrained sequence"
        if matcher.accept(token):
            return matcher.is_terminated
        log.warning("request %s: its grammar refused token %d (%s)", seq.request.request_id, token, matcher.error)
        return True

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence outside kUpdate (cancel, kill, shutdown), with the tokens and text held back."""
        seq.finish_reason = reason
        out = self._unsent(seq)
        seq.unsent = None
        if seq.detokenizer is not None:
            out.text += seq.detokenizer.finish()
        out.finish_reason, out.usage = reason, self._usage(seq)
        if seq.samples is not None:
            out.others_running = seq.samples.end_one()
        self._emit(seq.request, out)

    @staticmethod
    def _unsent(seq: Sequence) -> RequestOutput:
        """The output gathering `seq`'s tokens until the stream interval sends it."""
        if seq.unsent is None:
            seq.unsent = RequestOutput(seq.request.request_id, seq.request.session_id, index=seq.index)
            if seq.prompt_logprobs:  # all of them, with the first output (the prompt is computed by then)
                seq.unsent.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
            if seq.text_context is not None:  # the front end's detokenizer starts from it
                seq.unsent.text_context, seq.text_context = seq.text_context, None
        return seq.unsent

    @staticmethod
    def _usage(seq: Sequence) -> Usage:
        queued = (seq.first_scheduled or time.monotonic()) - seq.request.arrival
        return Usage(seq.num_prompt_tokens, seq.num_output, seq.num_cached_tokens, queued)

    # kDel --------------------------------------------------------------------------------------------------

    def _del(self, seq: Sequence) -> bool:
        """The sequence leaves the batch; its blocks go back to its session (True), or to the free list."""
        self.scheduler.remove(seq)
        session = seq.session
        session.active = None
        if seq.request.stateless or session.session_id not in self.sessions:
            self.blocks.release(seq.block_table)
            return False
        session.token_ids, session.block_table, session.num_computed = seq.token_ids, seq.block_table, seq.num_computed
        session.last_turn = EndedTurn(seq.request, seq.num_prompt_tokens)
        session.block_hashes, session.keyable = seq.block_hashes, seq.keyable
        session.last_used = self.num_steps
        if seq.num_output == 0 and seq.finish_reason is FinishReason.CANCELLED:
            # Cancelled before its first token: the turn leaves no trace, as one cancelled while still queued
            # does, so the history never depends on when the Cancel came. (Its input's KV goes with it.)
            self._truncate_history(session, len(seq.token_ids) - len(seq.request.input_ids))
            return True
        session.messages = (
            None if seq.conversation is None else [*seq.conversation, chat.assistant_reply(self._reply_text(seq))]
        )
        return True

    def _reply_text(self, seq: Sequence) -> str:
        """A chat turn's reply as its client received it, which its session keeps: the text this loop wrote, or
        else the front end's, written again here once, token by token by the same `IncrementalDetokenizer` over
        the same ids (without a stop id's) after the same context: it stops where the front end stopped, and
        the tokens drawn past a stop string before this loop heard of it change nothing."""
        detokenizer = seq.detokenizer
        if detokenizer is None:
            assert seq.reply_context is not None, "a chat turn whose text the front end writes"
            params, ids = seq.params, seq.output_ids
            if seq.finish_reason is FinishReason.STOP and ids and ids[-1] in seq.stop_ids:
                ids = ids[:-1]
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.stop, context=seq.reply_context
            )
            for token in ids:
                if detokenizer.step_one(token)[1]:
                    break
            detokenizer.finish()
        return detokenizer.text

    # failure and shutdown ----------------------------------------------------------------------------------

    def _fail_all(self, error: EngineError) -> None:
        """End every sequence with `error`, but those a failed step's kUpdate had already given their last output:
        their turns ended, and their sessions keep them. No KV the failed step may have written is kept."""
        self._inflight = None  # its draws are never read
        for seq in self.scheduler.running + list(self.scheduler.waiting):
            if seq.finish_reason is not None:
                if self._del(seq):  # its turn ended: its session keeps it in its history
                    self.blocks.release(seq.session.block_table)
            else:
                if seq.samples is None or not seq.samples.failed:  # one error ends the request, all its samples
                    self._emit(seq.request, RequestOutput(seq.request.request_id, seq.request.session_id, error=error))
                    if seq.samples is not None:
                        seq.samples.failed = True
                self.scheduler.remove(seq)
                self.blocks.release(seq.block_table)
                seq.session.active = None
            seq.session.drop_kv()
        self._forget_runs()

    def _forget_runs(self) -> None:
        """Every sequence ended: what the runs of the same rows kept of them is let go."""
        self.runner.inputs.forget()
        self._token_run = None

    def _cancel_all(self) -> None:
        for seq in self.scheduler.running + list(self.scheduler.waiting):
            if seq.finish_reason is None:  # a failed kUpdate may have ended it already
                self._finish(seq, FinishReason.CANCELLED)
            self._del(seq)
        for session in self.sessions.values():
            self.blocks.release(session.block_table)
            session.drop_kv()
        self.sessions.clear()
        self._forget_runs()

    # output ------------------------------------------------------------------------------------------------

    def _emit(self, request: Request, output: RequestOutput) -> None:
        self._signals.append((request, output))

    def _flush(self) -> None:
        events = self.blocks.take_events()  # published before the outputs, on the signal thread
        self.gateway.notify(self._signals, (self.rank, events) if events else None)
        self._signals = []
