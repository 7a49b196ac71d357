"""Per-sequence and per-session state. Owned by one engine loop's thread; nothing else touches it."""

from __future__ import annotations

import copy
import enum
import random
from dataclasses import dataclass

from ..sampling.constraints import CompiledGrammar, GrammarMatcher
from ..sampling.sampler import SampleRow
from ..text.detokenizer import IncrementalDetokenizer
from ..gateway.request import FinishReason, Request, RequestOutput


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # admitted, no KV yet (new or preempted)
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"


class HoldsKV:
    """KV blocks caching a token history's leading tokens. The caller releases the blocks; `drop_kv` forgets
    them."""

    __slots__ = ("block_table", "num_computed", "block_hashes", "keyable")

    def __init__(self) -> None:
        self.block_table: list[int] = []
        self.num_computed = 0  # leading tokens whose KV is in block_table
        self.block_hashes: list[bytes] = []  # prefix-cache digest of each full, computed block (block_manager.py)
        # False once weights change under this KV: its blocks, and those computed after them (which attend to
        # them), never enter the prefix cache, nor take blocks from it, until the KV is dropped.
        self.keyable = True

    def drop_kv(self) -> None:
        self.block_table, self.num_computed, self.block_hashes = [], 0, []
        self.keyable = True


@dataclass(frozen=True, slots=True)
class EndedTurn:
    """A session's last turn, which a stop string the front end found may still cut (`Gateway.stop_found`)."""

    request: Request
    num_prompt: int  # the history before its output


class Session(HoldsKV):
    """A conversation's token history, the truth, and the KV blocks that cache it (possibly dropped)."""

    __slots__ = ("session_id", "token_ids", "active", "messages", "last_used", "last_turn")

    def __init__(self, session_id: int) -> None:
        super().__init__()
        self.session_id = session_id
        self.token_ids: list[int] = []
        self.active: "Sequence | None" = None
        self.messages: list[dict] | None = []  # the conversation while every turn is messages, else None
        self.last_used = 0  # engine step, for choosing whose KV to drop under memory pressure
        self.last_turn: EndedTurn | None = None  # once a turn has ended


class Samples:
    """The sequences of one request's n samples (`SamplingParams.n`): the first prefills the prompt and forks
    the others when it draws its first token; the request ends when the last of them does."""

    __slots__ = ("to_fork", "live", "failed")

    def __init__(self, n: int) -> None:
        self.to_fork = n - 1  # samples not forked yet
        self.live = 1  # forked and not finished
        self.failed = False  # the request's error is sent (once, for all of them)

    def end_one(self) -> bool:
        """A sample finished; whether others still run (its last output is then not the request's). Samples not
        forked yet never will be: the first ended before it drew a token."""
        self.live -= 1
        return self.live > 0


class Sequence(HoldsKV):
    """One generation: history + new input as its prompt, then sampled tokens. Takes over its session's
    KV blocks at start and hands them back at the end. Slotted, as its fields are read hundreds of times a
    step."""

    __slots__ = (
        "request",
        "session",
        "params",
        "token_ids",
        "num_prompt_tokens",
        "num_cached_tokens",
        "max_new_tokens",
        "stop_ids",
        "detokenizer",
        "text_context",
        "seed",
        "status",
        "num_scheduled",
        "num_pending",
        "pending_row",
        "finish_reason",
        "unsent",
        "conversation",
        "reply_context",
        "first_scheduled",
        "follows",
        "index",
        "samples",
        "forks",
        "prompt_logprobs",
        "prompt_rows_planned",
        "grammar",
        "matcher",
        "_sample_row",
    )

    def __init__(
        self,
        request: Request,
        session: Session,
        detokenizer: IncrementalDetokenizer | None,
        max_new_tokens: int,
        eos_ids: frozenset[int],
    ) -> None:
        super().__init__()
        self.request = request
        self.session = session
        self.params = request.params
        self.token_ids = session.token_ids + request.input_ids
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = session.num_computed
        self.block_table, self.num_computed, self.block_hashes = (
            session.block_table,
            session.num_computed,
            session.block_hashes,
        )
        self.keyable = session.keyable
        self.max_new_tokens = max_new_tokens
        self.stop_ids = self.params.stop_ids(eos_ids)
        # Its text, where the loop writes it (a loop that is a thread of the serving process); None where the front
        # end does (`Gateway`), which its first output tells where the reply starts: `text_context`, None once sent.
        self.detokenizer = detokenizer
        self.text_context: list[int] | None = None
        self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(64)  # sampling.uniform
        self.status = SequenceStatus.WAITING
        self.num_scheduled = 0  # tokens this step will compute; set by the scheduler
        self.num_pending = 0  # tokens sampled on the device whose ids the host has not read yet (overlap)
        self.pending_row = 0  # the newest pending token's row among its step's sampled ids
        self.finish_reason: FinishReason | None = None
        self.unsent: RequestOutput | None = None  # tokens drawn but not yet sent (EngineConfig.stream_interval)
        self.conversation: list[dict] | None = None  # a chat turn's messages, this turn's included
        self.reply_context: list[int] | None = None  # a chat turn's ids before its reply, where the front end writes it
        self.first_scheduled: float | None = None  # monotonic time it first ran in a batch
        # While waiting: the running prefill whose blocks it shares, and the block up to which it waits for their
        # keys (`Scheduler._follows`)
        self.follows: tuple[Sequence, int] | None = None
        self.index = 0  # which of the request's samples
        self.samples = Samples(self.params.n) if self.params.n > 1 else None
        self.forks: list[Sequence] = []  # samples forked from it this step, drawing from its last row
        # The prompt's logprobs while they are computed (a list of TokenLogprob, from token 1), until sent.
        self.prompt_logprobs: list | None = [] if self.params.prompt_logprobs is not None else None
        self.prompt_rows_planned = 0  # prompt positions a step has been given to compute them for
        self.grammar: CompiledGrammar | None = None  # structured outputs: its constraint, compiled
        self.matcher: GrammarMatcher | None = None  # and where its output stands in it
        self._sample_row = SampleRow(self.params, self.seed, self.token_ids, self.num_prompt_tokens)

    def fork(self, index: int, num_computed: int) -> "Sequence":
        """Sample `index` of this sequence's request, taking its prompt and KV (the caller retains the blocks;
        the last one, if partly filled, is copied when either writes it) at `num_computed` tokens."""
        child = copy.copy(self)
        child.index = index
        child.session = Session(0)
        child.token_ids = list(self.token_ids)
        child.block_table, child.block_hashes = list(self.block_table), list(self.block_hashes)
        child.num_computed, child.num_scheduled = num_computed, 0
        child.num_cached_tokens = child.num_prompt_tokens  # its prompt's KV is the first sample's
        child.detokenizer = self.detokenizer.fresh() if self.detokenizer is not None else None
        seed = self.params.sample_seed(index)
        child.seed = seed if seed is not None else random.getrandbits(64)
        child.forks, child.prompt_logprobs, child.unsent = [], None, None
        child.matcher = self.grammar.matcher() if self.grammar is not None else None  # none drawn yet
        child._sample_row = SampleRow(child.params, child.seed, child.token_ids, child.num_prompt_tokens)
        return child

    def drop_kv(self) -> None:
        """Its KV will be recomputed: only what the prefix cache gives back when it is admitted again counts
        as cached."""
        super().drop_kv()
        self.num_cached_tokens = 0

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output(self) -> int:
        """Output tokens the host knows."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt and output, the tokens still on the device included."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def samples_this_step(self) -> bool:
        """Only the step that brings the KV up to the last token produces a new token."""
        return self.num_computed + self.num_scheduled == self.num_tokens

    def sample_row(self) -> SampleRow:
        """What the sampler reads of it this step: one row kept for its life (its token list is its own until
        it ends), brought up to date here rather than built again at every step."""
        row = self._sample_row
        row.num_pending = self.num_pending
        if self.params.min_new_tokens:
            row.banned_ids = self.banned_ids
        return row

    @property
    def banned_ids(self) -> list[int]:
        """Tokens that would end the turn early, while min_new_tokens is not reached yet."""
        return sorted(self.stop_ids) if self.num_output + self.num_pending < self.params.min_new_tokens else []
