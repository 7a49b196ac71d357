"""Which sequences run this step and how many tokens each computes. Owned by one engine loop's thread.

Policy: every running decode gets its token; running prefills, then waiting sequences (FIFO), share what is
left of the step's token budget, so a long prompt is prefilled in chunks while streams keep flowing. When
blocks run out the scheduler drops idle sessions' KV (their history recomputes on the next turn) where that
makes the room, else preempts the newest running sequence, which recomputes later, and tries again; a
request is never failed for lack of blocks.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from collections.abc import Iterable

from .block_manager import BlockKey, BlockManager
from .sequence import Sequence, SequenceStatus, Session

FOLLOW_MIN_TOKENS = 32  # `Scheduler._follows`: the least a waiting prompt shares with a prefill to wait for it


class Scheduler:
    def __init__(
        self, blocks: BlockManager, sessions: dict[int, Session], max_batch_size: int, max_batched_tokens: int
    ) -> None:
        self.blocks = blocks
        self.sessions = sessions
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.removed = 0  # sequences taken out (`remove`) so far
        self.unforked = 0  # samples that running sequences will fork: they count against max_batch_size
        # This step's copies on write, destination -> source: a block shared by a request's samples (forks),
        # partly filled, copied before the forward writes a sequence's next token into its own copy.
        self.copies: dict[int, int] = {}
        # Whether the last schedule found decodes only: none prefilled or admitted, none preempted
        self.decodes_only = False
        # A run of steps of the same decodes (`_steady_decodes`): the list the last schedule returned as such,
        # which sequences start a block at which step, the fewest tokens any could still draw at the first step
        # of the run, and the steps since.
        self._returned: list[Sequence] | None = None
        self._calendar: list[list[Sequence]] | None = None
        self._least = 0
        self._steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out of the queues; the caller decides what its blocks become."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._unfork(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.removed += 1
        if not self.running:  # what a run of the same decodes kept is let go
            self._returned = self._calendar = None

    def schedule(self) -> list[Sequence]:
        """Sequences to run, decodes first, each with `num_scheduled` set. The caller runs each step it is given
        before it asks again (a run of the same decodes counts on it: `_steady_decodes`)."""
        self.copies, self.decodes_only = {}, False
        for seq in self.waiting:
            seq.num_scheduled = 0
        preemptions = self.num_preemptions
        steady = self._steady_decodes()
        decodes, prefills = (steady, []) if steady is not None else self._decodes_and_prefills()
        budget = self.max_batched_tokens - len(decodes)
        for seq in prefills:
            budget -= self._schedule_prefill(seq, budget)
        admitted = False
        in_flight = self._in_flight(prefills) if self.waiting and budget > 0 and self.blocks.prefix_caching else {}
        i = 0  # the queue's first sequence not passed over (one that follows a prefill waits for it: `_follows`)
        while i < len(self.waiting) and budget > 0 and len(self.running) + self.unforked < self.max_batch_size:
            seq = self.waiting[i]
            if seq.num_pending:  # preempted with a token on the device: its prompt is whole once it is read
                break
            forks = seq.samples.to_fork if seq.samples is not None else 0
            if len(self.running) + self.unforked + 1 + forks > self.max_batch_size:
                break  # its samples, once forked, must fit in the batch
            if self._still_follows(seq):
                i += 1
                continue
            prefix = self.blocks.match_prefix(seq)
            if in_flight and self._follows(seq, prefix, in_flight):
                i += 1
                continue
            if not self._room_to_admit(seq, prefix, budget):
                break
            del self.waiting[i]
            if self.blocks.take_prefix(seq, prefix):
                seq.num_cached_tokens = max(seq.num_cached_tokens, min(seq.num_computed, seq.num_prompt_tokens))
            seq.status = SequenceStatus.RUNNING
            seq.first_scheduled = seq.first_scheduled or time.monotonic()
            self.running.append(seq)
            self.unforked += forks
            budget -= self._schedule_prefill(seq, budget)
            admitted = True
            if self.blocks.prefix_caching:
                self._add_in_flight(seq, in_flight)
        if not prefills and not admitted and preemptions == self.num_preemptions:
            self.decodes_only, self._returned = True, decodes
            return decodes  # each got its token (one that could not was preempted), in running order, and no other
        self._returned = None
        # A decode is one token that brings the KV to the sequence's end (ModelRunner.plan's test); a prefill
        # chunk that got the last token of budget is one token too, and must not sit among the decodes.
        first: list[Sequence] = []
        then: list[Sequence] = []
        for s in self.running:
            if s.num_scheduled:
                decode = s.num_scheduled == 1 and len(s.token_ids) + s.num_pending - s.num_computed == 1
                (first if decode else then).append(s)
        return first + then

    def _decodes_and_prefills(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences that decode this step, their blocks reserved, and those that prefill."""
        # One pass over hundreds of running sequences, `num_uncomputed` read inline. A sequence that has drawn its
        # max_new_tokens, the last perhaps still on the device (overlap), waits for them to be read: it then ends.
        # So does a constrained one whose last token is still on the device: its next mask needs that token
        # (structured outputs: it decodes every other step). Most decodes have room left in their last block and
        # no samples sharing it (`_reserve`'s own first test): they are scheduled in the same pass.
        self._calendar = None
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        bs = self.blocks.block_size
        to_reserve = False
        for s in self.running:
            computed, num_tokens = s.num_computed, len(s.token_ids) + s.num_pending
            uncomputed = num_tokens - computed
            if (
                uncomputed == 1
                and num_tokens - s.num_prompt_tokens < s.max_new_tokens
                and not (s.num_pending and s.matcher is not None)
            ):
                if computed < len(s.block_table) * bs and s.samples is None:
                    s.num_scheduled = 1
                else:
                    s.num_scheduled = 0
                    to_reserve = True
                decodes.append(s)
            else:
                s.num_scheduled = 0
                if uncomputed > 1:
                    prefills.append(s)
        if to_reserve:
            # The others in running order: one may preempt the newest sequences, which leave the batch (a
            # preempted sequence is waiting, its `num_scheduled` 0).
            for seq in decodes:
                if not seq.num_scheduled and seq.status is SequenceStatus.RUNNING and self._reserve(seq, 1):
                    seq.num_scheduled = 1
            decodes = [s for s in decodes if s.num_scheduled]
        return decodes, prefills

    def _steady_decodes(self) -> list[Sequence] | None:
        """Where the running sequences are those the last schedule returned as its decodes, each one step further
        (they all ran it): they all decode again, the same list, their blocks reserved; else None (the caller
        looks at each). Which of them start a block is known from where each stood when this run of steps
        began: a calendar of block_size lists, one per position in a block, read in turn, so that a step reserves
        for the few that need a block without looking at the others (`_reserve` for every sample of a request's
        n, as `_decodes_and_prefills` does). The run ends before its first sequence would reach max_new_tokens
        (overlap: it waits for its last token there), and at any change."""
        returned, running = self._returned, self.running
        if returned is None or len(returned) != len(running) or not all(map(operator.is_, running, returned)):
            return None
        bs = self.blocks.block_size
        if self._calendar is None:  # the first step of the run: where each stands, from its fields
            calendar: list[list[Sequence]] = [[] for _ in range(bs)]
            least = self.max_batched_tokens  # the fewest tokens any may still draw, or the run's longest
            for s in returned:
                if s.matcher is not None:
                    return None
                least = min(least, s.max_new_tokens - (len(s.token_ids) + s.num_pending - s.num_prompt_tokens))
                if s.samples is None:
                    calendar[s.num_computed % bs].append(s)
                else:
                    for sequences in calendar:
                        sequences.append(s)
            self._calendar, self._least, self._steps = calendar, least, 0
        else:
            self._steps += 1
        if self._least <= self._steps:  # one would draw past its max_new_tokens
            self._calendar = None
            return None
        preemptions = self.num_preemptions
        for seq in self._calendar[-self._steps % bs]:  # those whose next token starts a block
            if seq.status is SequenceStatus.RUNNING:
                self._reserve(seq, 1)  # where it preempts `seq` itself, `requeue` unschedules it
        if preemptions != self.num_preemptions:
            self._calendar = None
            return [s for s in returned if s.num_scheduled]
        return returned

    def fork(self, seq: Sequence) -> list[Sequence]:
        """The request's other samples, as `seq` is launched to draw its first token: each takes the prompt's KV
        blocks (shared; the last, if partly filled, copied when one writes it) and runs from now on, drawing its
        first token from `seq`'s row with its own seed (`Sequence.forks`, read by the step's plan)."""
        samples = seq.samples
        assert samples is not None, "only a request of n samples forks"
        self._unfork(seq)
        computed = seq.num_computed + seq.num_scheduled
        seq.forks = [seq.fork(index, computed) for index in range(1, 1 + samples.to_fork)]
        for fork in seq.forks:
            self.blocks.retain(fork.block_table)
            self.running.append(fork)
        samples.live += samples.to_fork
        samples.to_fork = 0
        return seq.forks

    def _unfork(self, seq: Sequence) -> None:
        """A running sequence leaves the batch, or forks: the samples it was to fork no longer count."""
        if seq.samples is not None:
            self.unforked -= seq.samples.to_fork

    def _room_to_admit(self, seq: Sequence, prefix: list[int], budget: int) -> bool:
        """Whether there is room for a waiting sequence's first chunk after `prefix`, the prefix-cache blocks it
        starts from. A cached block no one holds leaves the free list when taken, so it counts against the room:
        counted after taking it, a chunk cut by the budget found no room, preempted the sequence just admitted
        and admitted it again, forever."""
        computed = seq.num_computed + len(prefix) * self.blocks.block_size
        chunk = min(len(seq.token_ids) - computed, budget)
        grow = self.blocks.blocks_for(computed + chunk) - len(seq.block_table) - len(prefix)
        return self._make_room(grow, seq, taking=prefix)

    # A prompt that shares blocks with one being prefilled waits for them to be keyed, then takes them from the
    # prefix cache, instead of computing them beside it: a burst of requests with the same system prompt or
    # an RL trainer's copies of one prompt compute it once (SGLang deprioritizes such requests in the same way).
    # Only where they share this many tokens or more: waiting costs the follower a step.
    def _in_flight(self, prefills: list[Sequence]) -> dict[BlockKey, Sequence]:
        """The running prefills by the key of the block each will key next."""
        in_flight: dict[BlockKey, Sequence] = {}
        for seq in prefills:
            self._add_in_flight(seq, in_flight)
        return in_flight

    def _add_in_flight(self, seq: Sequence, in_flight: dict[BlockKey, Sequence]) -> None:
        found = self.blocks.next_key(seq, []) if seq.status is SequenceStatus.RUNNING else None  # not preempted
        if found is not None:
            in_flight.setdefault(found[1], seq)

    def _follows(self, seq: Sequence, prefix: list[int], in_flight: dict[BlockKey, Sequence]) -> bool:
        """Whether a waiting sequence, past the cached `prefix`, starts with FOLLOW_MIN_TOKENS or more of a
        running prefill's blocks not keyed yet: it then waits for them (`follows`, `_still_follows`). The first
        block's key (the digest of all before it, and its tokens) finds the prefill; the tokens after it are
        compared block by block."""
        lookup = self.blocks.lookup(seq)  # empty where it takes nothing from the cache (prompt logprobs, say)
        found = self.blocks.next_key(seq, prefix) if lookup else None
        leader = in_flight.get(found[1]) if found is not None else None
        if found is None or leader is None:
            return False
        bs, j = self.blocks.block_size, found[0]
        ids, theirs = seq.token_ids, leader.token_ids
        stop = min(lookup.stop, len(theirs) // bs)  # blocks it may take; blocks the leader keys
        end = j + 1  # block j is shared: its key holds the digest of all before it
        while end < stop and ids[end * bs : (end + 1) * bs] == theirs[end * bs : (end + 1) * bs]:
            end += 1
        if j >= stop or (end - j) * bs < FOLLOW_MIN_TOKENS:
            return False
        seq.follows = (leader, end)
        return True

    def _still_follows(self, seq: Sequence) -> bool:
        """Whether the prefill a waiting sequence follows is still running and has not keyed the blocks they share
        (`_follows`); once it has (or has ended, or been preempted, or its weights changed), the sequence is
        looked at again."""
        if seq.follows is None:
            return False
        leader, end = seq.follows
        if leader.status is SequenceStatus.RUNNING and leader.keyable and len(leader.block_hashes) < end:
            return True
        seq.follows = None
        return False

    def _schedule_prefill(self, seq: Sequence, budget: int) -> int:
        chunk = min(seq.num_uncomputed, budget)
        if chunk > 0 and seq.status is SequenceStatus.RUNNING and self._reserve(seq, chunk):
            seq.num_scheduled = chunk
        return seq.num_scheduled

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for `num_tokens` more tokens of `seq`, preempting newer sequences if need be; a copy of its
        last block where that is partly filled and shared (one of a request's samples)."""
        needed = -(-(seq.num_computed + num_tokens) // self.blocks.block_size) - len(seq.block_table)  # `blocks_for`
        if seq.samples is None or not self._shared_tail(seq):
            if needed <= 0:  # most decodes: the last block has room
                return True
            if self.blocks.can_allocate(needed):  # most of the others: a free block, no one preempted
                seq.block_table.extend(self.blocks.allocate(needed))
                return True
        while not self._make_room(max(needed, 0) + self._shared_tail(seq), seq):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        if self._shared_tail(seq):
            self._copy_on_write(seq)
        if needed > 0:
            seq.block_table.extend(self.blocks.allocate(needed))
        return True

    def _shared_tail(self, seq: Sequence) -> bool:
        """Whether the block its next token goes into is partly filled and held by others too: only ever one
        of a request's samples."""
        if seq.samples is None:
            return False
        j, filled = divmod(seq.num_computed, self.blocks.block_size)
        return bool(filled) and self.blocks.ref_counts[seq.block_table[j]] > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        """Give `seq` its own copy of its last block (the step copies it before its forward writes)."""
        (copy,) = self.blocks.allocate(1)
        j = seq.num_computed // self.blocks.block_size
        shared = seq.block_table[j]
        self.blocks.release([shared])
        seq.block_table = [*seq.block_table[:j], copy, *seq.block_table[j + 1 :]]  # a new list: `TableStore`
        self.copies[copy] = shared  # a later copy into the same block (freed meanwhile, handed out again) wins

    def _make_room(self, needed: int, seq: Sequence, taking: Iterable[int] = ()) -> bool:
        """True once `needed` blocks are free besides the free ones among `taking` (cached blocks about to be
        taken), after dropping idle sessions' KV, least recently used first, then the KV that waiting turns
        took over from their sessions, newest first: else a waiting turn could hold blocks that the head of
        the queue needs, and nothing would be admitted again. Where dropping all of it would not make room,
        none is dropped: the sessions would recompute their history for nothing."""

        def room() -> bool:
            return self.blocks.can_allocate(needed + self.blocks.num_free_of(taking))

        if room():
            return True
        idle = [s for s in self.sessions.values() if s.active is None and s.block_table and s is not seq.session]
        waiting = [s for s in reversed(self.waiting) if s is not seq and s.block_table]
        holders = sorted(idle, key=lambda s: s.last_used) + waiting
        gained = self.blocks.freed_by(h.block_table for h in holders) - set(taking)
        if not self.blocks.can_allocate(needed + self.blocks.num_free_of(taking) - len(gained)):
            return False
        for holder in holders:
            self.blocks.release(holder.block_table)
            holder.drop_kv()
            if room():
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's KV and queue it first in line; its tokens are recomputed, never lost."""
        self.requeue(seq)
        self.num_preemptions += 1

    def requeue(self, seq: Sequence) -> None:
        """A running sequence back to the head of the queue, its KV freed (recomputed when it runs again)."""
        self.running.remove(seq)
        self._unfork(seq)
        self.blocks.release(seq.block_table)
        seq.drop_kv()
        seq.num_scheduled = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
