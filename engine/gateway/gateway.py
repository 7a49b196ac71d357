"""The Gateway, after TurboMind's: routes requests to engine loops and delivers their outputs.

Lock order: `Gateway._admission_lock` is held across a Start's binding and a Generate's enqueue (so that once
a gate has closed, nothing that passed it is still on its way to a queue), and across an End's (or an idle
session's expiry's) unbinding, cancel and enqueue (so that a Start reusing the id follows the old session's
KILL); under it, and otherwise each a leaf:
  SequenceBinding._lock, RequestQueue._lock (or a RemoteQueue's), CancelFlag._lock, Gateway._arrivals.
Gateway._signal_cond is a leaf. No thread waits on one while holding another.
Callbacks run on the signal thread with no lock held. Engine loops wait on `_arrivals` (idle) and in the host
communicator's collectives (every step), never while holding a lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import random
import threading
import time
from collections import deque
from typing import Callable, Iterator, Sequence, cast

from ..errors import EngineError, InternalError, SessionExists, Unavailable
from ..comm import HostComm, RedOp
from .kv_events import KvEventLog, RawEvent
from .request import CancelFlag, FinishReason, Request, RequestKind, RequestOutput, StopFound, Usage, token_output
from .request_queue import QueueEnd, RequestQueue
from ..text.detokenizer import IncrementalDetokenizer
from ..text.tokenizer import Tokenizer
from .sequence_binding import SequenceBinding

log = logging.getLogger(__name__)

# An output for a request; or a delta of one token id and nothing else, as (request, token id, the sample's
# index, the weights' version), or with the token's text after those (a loop that writes text, no stop string
# holding it back): most of a step's outputs, which a loop hands over as such, and the signal thread makes
# outputs of (`token_output`), off the loop's thread.
Signal = tuple[Request, RequestOutput] | tuple[Request, int, int, str] | tuple[Request, int, int, str, str]
KvStep = tuple[int, list[RawEvent]]  # a loop's rank and the prefix-cache events of one of its steps
SLEEP_GATE = "sleep"  # closed from a Sleep until the Wakeup that leaves nothing asleep


class Gateway:
    """Shared by the caller threads (push, cancel, kill), the engine loops (pop, notify) and the signal thread."""

    def __init__(
        self,
        num_queues: int = 1,
        max_queued: int = 1024,
        queues: Sequence[QueueEnd] | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """`queues`: the ranks' own (a rank in another process has a stand-in); else `num_queues` new ones.
        `tokenizer`: the front end's, which writes the text of outputs their loops left it (`detokenize`): where
        the loops are rank processes. Where they are threads of this process they write it all, and a rank
        process's Gateway has none either (its outputs carry their ids to the serving process's)."""
        self.tokenizer = tokenizer
        self.queues: Sequence[QueueEnd] = queues or [RequestQueue(max_queued) for _ in range(num_queues)]
        self.binding = SequenceBinding()
        self._next_rank = itertools.count()  # next() on a count is atomic in CPython
        self._next_id = itertools.count(1)
        self._admission_lock = threading.Lock()  # guards _closed_gates
        self._closed_gates: dict[str, str] = {}
        self._arrivals = threading.Condition()  # guards _num_arrivals; idle engine loops wait on it
        self._num_arrivals = 0
        self._signals: deque[tuple[KvStep | None, list[Signal]]] = deque()  # a step's events and outputs each
        self._signal_cond = threading.Condition()  # guards _signals, _stopping and _drained
        self._stopping = False
        self._drained = False  # the signal thread has delivered its last hand-off and returned
        self._signal_thread = threading.Thread(target=self._signal_loop, name="lmgate-signal", daemon=True)
        self._signal_thread.start()
        self.kv_events = KvEventLog()  # the loops' prefix-cache block events, for a gateway's router
        self._stops: list[deque[StopFound]] = [deque() for _ in self.queues]  # per loop: its samples to end

    # admission ---------------------------------------------------------------------------------------------

    def close_admission(self, gate: str, message: str) -> None:
        """Refuse Start and Generate while any gate is closed (sleep, shutdown), with that gate's message. On
        return, every Start and Generate admitted before has bound its session or reached its queue: a control
        request queued after this follows them."""
        with self._admission_lock:
            self._closed_gates[gate] = message

    def open_admission(self, gate: str) -> None:
        with self._admission_lock:
            self._closed_gates.pop(gate, None)

    def gate_closed(self, gate: str) -> bool:
        with self._admission_lock:
            return gate in self._closed_gates

    @contextlib.contextmanager
    def _admitted(self) -> Iterator[None]:
        """Holds admission open for the caller's block, or raises UNAVAILABLE with a closed gate's message."""
        with self._admission_lock:
            if self._closed_gates:
                raise Unavailable(next(iter(self._closed_gates.values())))
            yield

    # caller side -------------------------------------------------------------------------------------------

    def start_session(self, session_id: int) -> int:
        """Bind a new session to an engine loop, round robin; 0 picks an unused id."""
        with self._admitted():
            rank = self._next_loop()
            if session_id:
                self.binding.bind(session_id, rank)
                return session_id
            while True:
                session_id = random.getrandbits(63) + 1
                try:
                    self.binding.bind(session_id, rank)
                    return session_id
                except SessionExists:  # an id collision: draw again
                    continue

    def push(self, request: Request) -> None:
        """Queue a generate request: stateless ones round robin, session turns to their session's loop."""
        with self._admitted():
            if request.stateless:
                rank = self._next_loop()
            else:
                rank = self.binding.claim(request.session_id, request)
            try:
                if not self.enqueue(rank, request):
                    raise Unavailable("the engine is shutting down")
            except Exception:  # refused (or it could not be sent): the session is free for its next turn
                if not request.stateless:
                    self.binding.release(request.session_id, request)
                raise

    def control(self, kind: RequestKind) -> list[RequestOutput]:
        """Send a control request to every engine loop and wait until each has handled it at a step boundary;
        their answers. Raises the first error a loop answered with (a KV cache that could not be allocated
        again), or UNAVAILABLE where the engine shut down before a loop handled it: the caller must not go on
        to free what that loop may still be using."""
        pending = threading.Semaphore(0)
        errors: list[EngineError] = []
        answers: list[RequestOutput] = []
        shut_down = Unavailable("the engine is shutting down")

        def answered(output: RequestOutput) -> None:
            answers.append(output)
            if output.error is not None:
                errors.append(output.error)
            elif output.finish_reason is FinishReason.CANCELLED:  # closed in the queue, never handled
                errors.append(shut_down)
            pending.release()

        for rank in range(len(self.queues)):
            if not self.enqueue(rank, Request(kind, 0, answered)):
                errors.append(shut_down)
                pending.release()
        for _ in self.queues:
            pending.acquire()
        if errors:
            raise errors[0]
        return answers

    def kill(self, session_id: int, on_done: Callable[[RequestOutput], None]) -> None:
        """End a session: later requests on it are NOT_FOUND at once; `on_done` runs after its engine loop has
        cancelled its active generation and freed its KV. Ending an unknown session is a no-op.

        A turn still queued is cancelled here: kills overtake queued turns, so it would otherwise outlive End,
        and run inside a new session started with the same id on the same loop. Under the admission lock, a
        Start of the same id binds only once the KILL is queued, so its turns follow the KILL."""
        request = Request(RequestKind.KILL, session_id, on_done)
        with self._admission_lock:
            bound = self.binding.unbind(session_id)
            active = bound.active if bound is not None else None
            was = self._flag_cancelled(active) if active is not None else None  # a rank process hears first
            queued = bound is not None and self.enqueue(bound.rank, request)
        if was == CancelFlag.QUEUED:
            assert active is not None  # `was` is only read from an active request
            self.notify([(active, cancelled_output(active))])
        if not queued:
            self.notify([(request, unanswered_output(request))])

    def expire_idle(self, idle_seconds: float, now: float | None = None) -> list[int]:
        """End the sessions that have had no turn for `idle_seconds` (`now`: time.monotonic's), as `kill` ends
        one: later requests on them are NOT_FOUND, and their loops free their KV. Their ids."""
        cutoff = (time.monotonic() if now is None else now) - idle_seconds
        with self._admission_lock:
            expired = self.binding.take_idle(cutoff)
            for session_id, bound in expired.items():
                self.enqueue(bound.rank, Request(RequestKind.KILL, session_id, lambda _: None))
        return list(expired)

    def cancel(self, request: Request) -> bool:
        """Flip the flag; a queued request ends here and now, an active one at its loop's next step (a loop in
        another process is told through the request's `on_cancel`). The loops are woken: one idle while it
        holds frozen requests (a pause) steps to end it."""
        old = self._flag_cancelled(request)
        if old == CancelFlag.QUEUED:
            self.notify([(request, cancelled_output(request))])
        elif old == CancelFlag.ACTIVE:
            self.wake_loops()
        return old in (CancelFlag.QUEUED, CancelFlag.ACTIVE)

    @staticmethod
    def _flag_cancelled(request: Request) -> int:
        """Flip the flag to CANCELLED, telling a loop in another process of an active request (`on_cancel`:
        its queue's lock is a leaf); the flag it had."""
        old = request.cancel_flag.cancel()
        if old == CancelFlag.ACTIVE and request.on_cancel is not None:
            request.on_cancel()
        return old

    def enqueue(self, rank: int, request: Request) -> bool:
        """Put a request in loop `rank`'s queue and wake the loops; False once that queue is closed."""
        if not self.queues[rank].push(request):
            return False
        self.wake_loops()
        return True

    def _next_loop(self) -> int:
        """The loop of a new session or stateless request: round robin."""
        return next(self._next_rank) % len(self.queues)

    def wake_loops(self) -> None:
        """Idle loops wait for the arrival count to change (`pop`); also called for arrivals at other ranks'
        processes, which idle loops here must follow."""
        with self._arrivals:
            self._num_arrivals += 1
            self._arrivals.notify_all()

    # engine side -------------------------------------------------------------------------------------------

    def pop(self, rank: int, max_infer: int, has_work: Callable[[], bool], comm: HostComm) -> list[Request] | None:
        """New work for engine loop `rank`, or None once the loops stop.

        Every loop calls this once per step, and the loops agree through an AllReduce of [ready, closed]:
        they all run a step as soon as one of them has work (TurboMind's dp_thr, here 1, so no stream waits
        for a peer to fill up), wait together while none has, and stop together once a queue is closed, so
        no loop is ever left waiting in a collective for a peer that has gone. Requests cancelled while
        queued are skipped; the others get unique ids.
        """
        queue = self.own_queue(rank)
        while True:
            with self._arrivals:
                seen = self._num_arrivals
            queued, closed = queue.state()
            reduced = comm.all_reduce([int(has_work() or queued), int(closed)], RedOp.SUM)
            num_ready, num_closed = cast("list[int]", reduced)  # a list reduces to a list
            if num_closed:
                return None  # close() handed back whatever was queued
            if num_ready:
                break
            # Idle everywhere: wait for a request queued anywhere. The loops read the arrival count at
            # different moments, so they agree on the oldest reading: all then leave the wait together.
            oldest = comm.all_reduce(seen, RedOp.MIN)
            with self._arrivals:
                self._arrivals.wait_for(lambda: self._num_arrivals != oldest)
        return self._activate(queue.pop(max_infer) or [])  # closed since the agreement: seen and agreed next step

    def take_queued(self, rank: int) -> list[Request]:
        """Loop `rank`'s generates still queued behind a full batch, taken as `pop` takes them (a pause that
        aborts ends them too)."""
        return self._activate(self.own_queue(rank).take_generates())

    def own_queue(self, rank: int) -> RequestQueue:
        """Loop `rank`'s queue, which it takes from: a loop runs in the process of its Gateway and its queue."""
        queue = self.queues[rank]
        assert isinstance(queue, RequestQueue), "a rank in another process takes from its own Gateway's queue"
        return queue

    def _activate(self, requests: list[Request]) -> list[Request]:
        """The requests a loop takes: those cancelled while queued skipped, the others with unique ids."""
        live = []
        for r in requests:
            if r.kind is RequestKind.GENERATE and not r.cancel_flag.compare_exchange(
                CancelFlag.QUEUED, CancelFlag.ACTIVE
            ):
                continue
            r.unique_id = next(self._next_id)
            live.append(r)
        return live

    def notify(self, signals: list[Signal], kv_step: KvStep | None = None) -> None:
        """Hand outputs to the signal thread; one hand-off per engine step, never blocking on a client. With a
        loop's step, its prefix-cache events, which that thread publishes first (`publish_kv_events`): a client
        that sees its reply finds its prompt's blocks published, and the loop does not wait on the log's lock.
        Once that thread has delivered its last hand-off and returned, the caller delivers them itself, so no
        callback is ever lost and none overtakes an earlier step's."""
        if not signals and kv_step is None:
            return
        with self._signal_cond:
            if not self._drained:  # while it stops it still drains what it is handed, in order
                self._signals.append((kv_step, signals))
                self._signal_cond.notify()
                return
        self._hand_over(kv_step, signals)

    def stop_found(self, rank: int, found: StopFound) -> None:
        """The front end found a stop string in a sample of loop `rank` (a rank process's receiver tells it
        here): the loop ends the sample there at its next step, before it adds the requests it took with it
        (the session's next turn among them, which the client sent once it read the end)."""
        self._stops[rank].append(found)
        self.wake_loops()

    def has_stops(self, rank: int) -> bool:
        return bool(self._stops[rank])

    def take_stops(self, rank: int) -> list[StopFound]:
        stops = self._stops[rank]
        return [stops.popleft() for _ in range(len(stops))]

    def publish_kv_events(self, rank: int, events: list[RawEvent]) -> None:
        """A loop's prefix-cache events of one step, before its outputs are delivered (a client that sees its
        reply and sends the next turn finds them published): on the signal thread (`notify`), or the rank
        receiver's for a rank process, whose own gateway sends them instead."""
        self.kv_events.publish(rank, events)

    def shutdown(self, error: EngineError | None = None) -> None:
        """Refuse new work and end what is still queued: CANCELLED, or with `error` (a rank failed)."""
        self.close_admission("shutdown", "the engine is shutting down")
        for queue in self.queues:
            for request in queue.close():
                if request.kind is RequestKind.KILL:
                    self.notify([(request, unanswered_output(request))])
                elif error is None:
                    self.cancel(request)
                elif request.cancel_flag.compare_exchange(CancelFlag.QUEUED, CancelFlag.CANCELLED):
                    self.notify([(request, RequestOutput(request.request_id, request.session_id, error=error))])
        self.wake_loops()

    def stop_signals(self) -> None:
        with self._signal_cond:
            self._stopping = True
            self._signal_cond.notify()
        self._signal_thread.join()

    # signal thread -----------------------------------------------------------------------------------------

    def _signal_loop(self) -> None:
        try:
            while True:
                with self._signal_cond:
                    self._signal_cond.wait_for(lambda: self._signals or self._stopping)
                    if not self._signals:
                        self._drained = True  # every hand-off before this one delivered: callers deliver their own
                        return
                    kv_step, batch = self._signals.popleft()
                try:
                    self._hand_over(kv_step, batch)
                except Exception:  # a bug, or a rank's outbox that failed: later steps' outputs still go
                    log.exception("handing a step's outputs over failed")
        finally:  # should this thread die anyway, callers deliver their own rather than queue to no one
            with self._signal_cond:
                self._drained = True

    def _hand_over(self, kv_step: KvStep | None, signals: list[Signal]) -> None:
        if kv_step is not None:
            self.publish_kv_events(*kv_step)
        if signals:
            self._deliver_all(signals)

    def _deliver_all(self, signals: list[Signal]) -> None:
        """Each output to its callback. Hundreds a step: one that is not its request's last and has no text for
        this side to write (most of them) goes straight there."""
        settle_all = self.tokenizer is not None
        for signal in signals:
            if len(signal) == 4:  # a token delta
                request, token, index, version = signal
                output = token_output(request.request_id, request.session_id, [token], index, version)
            elif len(signal) == 5:  # and its text
                request, token, index, version, text = signal
                output = token_output(request.request_id, request.session_id, [token], index, version, text)
            else:
                request, output = signal
            if settle_all or output.finish_reason is not None or output.error is not None:
                settled = self._settle(request, output)
                if settled is None:
                    continue
                output = settled
            try:
                request.on_output(output)
            except Exception:
                log.exception("output callback of request %r failed", request.request_id)

    def _settle(self, request: Request, output: RequestOutput) -> RequestOutput | None:
        """Before an output reaches its caller: the text its loop left to this side, and at a request's end
        its flag and its session's binding. The output to hand the caller; None for one held back (`detokenize`)."""
        if self.tokenizer is not None:
            try:
                written = detokenize(self.tokenizer, request, output)
                if written is None:
                    return None
                output = written
            except Exception as exc:  # the stream ends with the error, its loop ends the request; this thread goes on
                log.exception("detokenizing request %r failed", request.request_id)
                output.error = InternalError(f"detokenizing the output failed: {exc}")
                request.detokenizers.clear()
                request.held.clear()
                self.cancel(request)
        # Release the session before the last output reaches the client, so its next turn is never refused.
        if output.finished and request.kind is RequestKind.GENERATE:
            # A Cancel from now on, before the client has read it, cancels nothing. Only from ACTIVE: a cancelled
            # request stays CANCELLED, which its queue drops it by and its session's next turn is admitted by.
            finished = request.cancel_flag.compare_exchange(CancelFlag.ACTIVE, CancelFlag.FINISHED)
            if not finished and output.error is None:  # a Cancel after the loop's last word, told it cancelled
                output.finish_reason = FinishReason.CANCELLED  # (its tokens stay in the history, as a cancel's do)
            if not request.stateless:
                self.binding.release(request.session_id, request)
        return output


def detokenize(tokenizer: Tokenizer, request: Request, output: RequestOutput) -> RequestOutput | None:
    """The text of a sample whose loop, in a rank process, left it to the serving process (engine/README.md,
    invariant 13): its first output brings the ids before the reply (`RequestOutput.text_context`), its last
    one the end of its text. Any other output's text was written by its loop, and passes untouched.

    A stop string is found here too. Its output is cut after the token that completed it and held back, and
    the loop is told to end the sample there (`Request.on_stop`); the tokens the loop drew before it heard are
    dropped, and its last output brings the held one to the caller (`_ended_at_stop`). The output to hand the
    caller; None while one is held."""
    index = output.index
    last = output.finish_reason is not None or output.error is not None  # the sample's last
    if index in request.held:
        if not last:
            return None  # past the stop string
        held, kept = request.held.pop(index)
        return _ended_at_stop(held, output, kept)
    detokenizers = request.detokenizers
    if output.text_context is not None:
        detokenizers[index] = IncrementalDetokenizer(
            tokenizer, request.params.skip_special_tokens, request.params.stop, context=output.text_context
        )
        output.text_context = None
    detokenizer = detokenizers.get(index)
    if detokenizer is None:
        return output
    ids = output.token_ids
    if (
        output.finish_reason is FinishReason.STOP
        and ids
        and ids[-1] in request.params.stop_ids(tokenizer.eos_token_ids)
    ):
        ids = ids[:-1]  # a stop id's text is left out, as the loop leaves it out (and vLLM does)
    if not request.params.stop:
        if ids:
            output.text = "".join([detokenizer.step_one(token)[0] for token in ids])
    else:
        texts = []
        for at, token in enumerate(ids):
            text, hit = detokenizer.step_one(token)
            texts.append(text)
            if hit:
                output.text = "".join(texts)
                return _stop_found(request, output, at + 1, detokenizer, last)
        output.text = "".join(texts)
    if last:
        if output.error is None:
            output.text += detokenizer.finish()
            # A stop string that only the final decode revealed, where the loop would find it: not at a cancel
            if detokenizer.stopped and output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                output.finish_reason, output.stop_string = FinishReason.STOP, detokenizer.stop_string
        del detokenizers[index]
    return output


def _stop_found(
    request: Request, output: RequestOutput, keep: int, detokenizer: IncrementalDetokenizer, last: bool
) -> RequestOutput | None:
    """`output` ends its sample after its first `keep` tokens: the last output, or one held back while its loop
    is told. A loop that had ended a session's turn further on is told too, so that the history ends here
    (before the client can send the next turn, which follows on the same link)."""
    kept = detokenizer.num_tokens
    past = len(output.token_ids) > keep
    del output.token_ids[keep:], output.logprobs[keep:]
    output.stop_string = detokenizer.stop_string
    del request.detokenizers[output.index]
    assert request.on_stop is not None, "a front end that writes the text has a link to the loop"
    if not last:
        request.held[output.index] = (output, kept)
        request.on_stop(output.index, kept)
        return None
    if past and not request.stateless:
        request.on_stop(output.index, kept)
    return _ended_at_stop(output, output, kept)


def _ended_at_stop(held: RequestOutput, last: RequestOutput, kept: int) -> RequestOutput:
    """The held output, with what the sample's last output says of its end: STOP, but for an error, and its
    usage counting the `kept` tokens the caller gets."""
    held.error, held.others_running = last.error, last.others_running
    held.finish_reason = None if last.error is not None else FinishReason.STOP
    held.usage = None if last.usage is None else dataclasses.replace(last.usage, completion_tokens=kept)
    return held


def cancelled_output(request: Request) -> RequestOutput:
    """The last output of a turn that ended before it ran: all its time so far was spent queued."""
    return RequestOutput(
        request.request_id,
        request.session_id,
        finish_reason=FinishReason.CANCELLED,
        usage=Usage(prompt_tokens=len(request.input_ids), queue_seconds=time.monotonic() - request.arrival),
    )


def unanswered_output(request: Request) -> RequestOutput:
    """The last output of a request no engine loop will handle: a generate or a control CANCELLED (a Sleep
    then knows that no loop handled it), a session's End done."""
    if request.kind is RequestKind.GENERATE:
        return cancelled_output(request)
    reason = FinishReason.STOP if request.kind is RequestKind.KILL else FinishReason.CANCELLED
    return RequestOutput("", request.session_id, finish_reason=reason)
