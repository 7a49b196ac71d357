"""What crosses threads: a request with its atomic cancel flag, and the outputs the engine sends back."""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..errors import EngineError
from ..sampling.sampler import SamplingParams
from ..text.detokenizer import IncrementalDetokenizer


class FinishReason(enum.Enum):
    STOP = "stop"  # end-of-sequence token, stop token id or stop string
    LENGTH = "length"  # max_new_tokens or the context window
    CANCELLED = "cancelled"  # Cancel, End, disconnect, sleep or shutdown
    ABORTED = "aborted"  # a pause that aborts: partial output, to be sent again after the resume


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the session or the prefix cache, not a prefill
    queue_seconds: float = 0.0  # from submission until the request first ran in a batch


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RequestOutput:
    """One delta of a stream; the last carries finish_reason and usage, or an error. Of a request with n
    samples, each sample's deltas carry its `index`, and each sample's last its finish_reason and usage: the
    request's last is the one of those without `others_running`."""

    request_id: str
    session_id: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: EngineError | None = None
    index: int = 0  # which of the request's samples
    others_running: bool = False  # this sample ended, others of the request have not
    prompt_logprobs: list[TokenLogprob] | None = None  # on sample 0's first output, when asked: from token 1
    stop_string: str | None = None  # on a last output: the stop string that ended it
    weight_version: str = ""  # the weights that computed token_ids (one version per output); "" without tokens
    handled: int = 0  # a pause's answer: the requests it ended or froze at that loop
    # On a sample's first output, where its text is left to the front end (`Gateway`): the ids before the reply
    # that its detokenizer starts from (`reply_context`). None: the loop wrote `text` (stop strings, chat turns).
    text_context: list[int] | None = None

    @property
    def finished(self) -> bool:
        """The request's last output."""
        return (self.finish_reason is not None and not self.others_running) or self.error is not None

    @property
    def only_tokens(self) -> bool:
        """A delta of token ids and nothing else but whose (request_id, session_id, index) and of which weights:
        most of a stream's outputs, which a rank process sends as a tuple of those fields (`to_wire`)."""
        return not (
            self.text
            or self.logprobs
            or self.finish_reason is not None
            or self.usage is not None
            or self.error is not None
            or self.others_running
            or self.prompt_logprobs is not None
            or self.stop_string is not None
            or self.handled
            or self.text_context is not None
        )

    def __reduce__(self) -> tuple:
        """Pickled as its fields in order: a rank process sends a few hundred a step, and pickle's way with a
        slotted dataclass (a dict of its slots each) takes over twice as long to write and to read."""
        return RequestOutput, (
            self.request_id,
            self.session_id,
            self.token_ids,
            self.text,
            self.logprobs,
            self.finish_reason,
            self.usage,
            self.error,
            self.index,
            self.others_running,
            self.prompt_logprobs,
            self.stop_string,
            self.weight_version,
            self.handled,
            self.text_context,
        )


def token_output(
    request_id: str, session_id: int, token_ids: list[int], index: int, weight_version: str, text: str = ""
) -> RequestOutput:
    """A delta of token ids and their text, if any, and nothing else (without text: `RequestOutput.only_tokens`),
    built positionally (hundreds a step: faster than by name)."""
    return RequestOutput(
        request_id, session_id, token_ids, text, [], None, None, None, index, False, None, None, weight_version
    )


class CancelFlag:
    """TurboMind's three-state flag: 0 queued, 1 active, -1 cancelled; and 2 finished, once an active request's
    last output is handed to the caller (a Cancel then cancels nothing; a cancelled one stays cancelled).
    Each transition is one atomic swap, so exactly one side (the canceller or the engine) handles a given
    cancel."""

    QUEUED, ACTIVE, CANCELLED, FINISHED = 0, 1, -1, 2
    # Flags of this process cancelled so far, each counted after it flipped: a loop looks for cancelled
    # sequences only once this moved since it last looked (`cancels`), not at every step.
    _cancels = 0
    _cancels_lock = threading.Lock()  # a leaf: guards _cancels only, taken after a flag's lock is let go

    def __init__(self) -> None:
        self._value = self.QUEUED
        self._lock = threading.Lock()  # guards _value only; never held while calling out

    @property
    def value(self) -> int:
        return self._value

    @classmethod
    def cancels(cls) -> int:
        return cls._cancels

    def cancel(self) -> int:
        """CANCELLED unless finished; the state it had."""
        with self._lock:
            old = self._value
            if old != self.FINISHED:
                self._value = self.CANCELLED
        if old != self.FINISHED:
            with CancelFlag._cancels_lock:
                CancelFlag._cancels += 1
        return old

    def compare_exchange(self, expected: int, new: int) -> bool:
        # An active request is cancelled by `cancel` alone, which the loops count (`cancels`): they would miss it
        assert not (expected == self.ACTIVE and new == self.CANCELLED), "cancel an active request with cancel()"
        with self._lock:
            if self._value != expected:
                return False
            self._value = new
            return True


class RequestKind(enum.Enum):
    GENERATE = "generate"
    KILL = "kill"  # end a session: cancel its active generation, free its KV
    SLEEP = "sleep"  # control: cancel everything, end all sessions, free the KV cache
    WAKE_KV = "wake_kv"  # control: allocate the KV cache again
    FLUSH_CACHE = "flush_cache"  # control: forget the prefix cache's keys; blocks in use stay in use
    # A pause (Engine.pause), each answered with the number of requests it ended or froze (`handled`):
    ABORT = "abort"  # control: end every running and queued generate (FinishReason.ABORTED)
    AWAIT_IDLE = "await_idle"  # control: answered once nothing runs or is queued (what was frozen goes on)
    FREEZE = "freeze"  # control: run nothing until THAW; KV of replaced weights is recomputed by the new ones
    FREEZE_KEEP_KV = "freeze_keep_kv"  # control: as FREEZE, but KV of replaced weights is kept
    THAW = "thaw"  # control: frozen requests go on


@dataclass(eq=False)
class Request:
    """Built on the caller's thread, then owned by one engine loop once popped.

    `on_output` runs on the Gateway's signal thread, never on the engine loop; it must not block.
    """

    kind: RequestKind
    session_id: int
    on_output: Callable[[RequestOutput], None]
    request_id: str = ""
    input_ids: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    stateless: bool = True
    session_epoch: int | None = None  # the copy of the session the caller's history belongs to (None: any)
    messages: list[dict] | None = None  # a session turn given as chat messages (chat.py); input_ids set by its loop
    # A session's text turn: its ids as a stateless prompt's (a BOS, where the model has one; a SentencePiece
    # space), which its loop takes instead of input_ids if the session holds no tokens yet (its first turn).
    first_turn_ids: list[int] = field(default_factory=list)
    unique_id: int = -1  # assigned by Gateway.pop, monotonically increasing
    cancel_flag: CancelFlag = field(default_factory=CancelFlag)
    on_cancel: Callable[[], None] | None = None  # tells a loop in another process that an active request was cancelled
    # Tells a loop in another process that the front end found a stop string in sample `index`, which keeps its
    # first `num_output` tokens: (index, num_output). Set with `on_cancel`.
    on_stop: Callable[[int, int], None] | None = None
    arrival: float = field(default_factory=time.monotonic)  # when it was submitted
    # Each sample's detokenizer, where the front end writes its outputs' text: the signal thread's only.
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    # A sample whose stop string the front end found, until its loop's last output: the output that ends it there,
    # held back, and the sample's tokens through the stop string. The signal thread's only.
    held: dict[int, tuple[RequestOutput, int]] = field(default_factory=dict)
    # Whether the caller reads the outputs' text. False (the gateway's worker protocol, which reads ids): no text
    # is written but what a stop string or a chat turn needs, and outputs carry it only then.
    text: bool = True


@dataclass(frozen=True, slots=True)
class StopFound:
    """A stop string the front end found in a sample whose text it writes (its loop in a rank process): the sample
    keeps its first `num_output` tokens, as if its loop had stopped there (`Gateway.stop_found`)."""

    request: Request | None  # None once its rank process has let go of it: its loop ended the sample already
    session_id: int  # 0 for a stateless request
    index: int  # which of the request's samples
    num_output: int
