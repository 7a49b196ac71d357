"""Sampling parameters (validated at the door) and the batched sampler the model runner calls."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidRequest
from ..kernels import layer_kernels
from ..machine.transfers import to_device
from .constraints import Constraint, apply_token_mask
from .logprobs import LOGPROBS_MODES, step_logprobs

MAX_LOGPROBS = 20
MAX_SAMPLES = 128  # n: within the engine's max_batch_size too, checked where that is known
MAX_LOGIT_BIAS = 1024  # biased ids: each one an indexed update of its row every step
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256  # each is looked up every step, and banned every step below min_new_tokens
GREEDY_BELOW = 1e-5  # a temperature under this is greedy (as vLLM): dividing by less overflows the logits
# How far a penalty may push a logit: any temperature that samples (>= GREEDY_BELOW, whose float32 is a little less)
# keeps it inside float32, where +inf would turn the row's softmax NaN and its draw an id past the vocabulary (a
# repetition penalty of 1e-38).
PENALIZED_LIMIT = torch.finfo(torch.float32).max * GREEDY_BELOW / 2


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Zero values mean "off": temperature 0 (or below GREEDY_BELOW) is greedy, top_k 0 / top_p 0 or 1 / min_p 0
    disable the filter.

    `logprobs_mode` says what `logprobs` are of (logprobs.py): "raw", the model's distribution (log-softmax of
    its logits, before logit_bias, penalties, structured outputs' mask, temperature and the filters); or
    "processed", the distribution the token was drawn from (after all of them, renormalized; a token they
    removed has -inf). A greedy request's processed distribution is taken at temperature 1, the other
    processing applied."""

    max_new_tokens: int = 0  # 0: the engine's default, bounded by the context window
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # top-n alternatives per token; 0: none
    logprobs_mode: str = "raw"  # "raw" | "processed": which distribution `logprobs` are of (see above)
    skip_special_tokens: bool = True
    n: int = 1  # samples of the prompt; sample i draws as seed + i would (`sample_seed`)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    prompt_logprobs: int | None = None  # top-n alternatives per prompt token; None: no prompt logprobs
    constraint: Constraint | None = None  # structured outputs: what the output must match (constraints.py)
    keep_kv_on_update: bool = False  # frozen across an update: the old weights' KV kept, not recomputed
    # Derived from the fields above once, in `__post_init__`: the sampler reads them for every row at every step.
    greedy: bool = field(init=False, repr=False, compare=False)
    penalized: bool = field(init=False, repr=False, compare=False)  # a repetition, presence or frequency penalty
    adjusts_logits: bool = field(init=False, repr=False, compare=False)  # penalized, or a logit bias
    # (temperature, min_p, top_k, top_p) as the sampler applies them: top_k 0 and top_p 1 are off.
    columns: tuple[float, float, int, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequest(f"{name} must be a finite number, got {getattr(self, name)}")
        _check(self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        _check(self.min_new_tokens >= 0, f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        _check(
            not self.max_new_tokens or self.min_new_tokens <= self.max_new_tokens,
            f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})",
        )
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 <= self.top_p <= 1, f"top_p must be in [0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty >= 0, f"repetition_penalty must be >= 0, got {self.repetition_penalty}")
        _check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _check(
            self.logprobs_mode in LOGPROBS_MODES,
            f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}",
        )
        _check(self.seed is None or 0 <= self.seed < 2**64, f"seed must be in [0, 2^64), got {self.seed}")
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings")
        _check(all(self.stop), "stop strings must not be empty")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0")
        _check(1 <= self.n <= MAX_SAMPLES, f"n must be in [1, {MAX_SAMPLES}], got {self.n}")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, f"at most {MAX_LOGIT_BIAS} logit_bias entries")
        for token, bias in self.logit_bias:
            _check(token >= 0, f"logit_bias token ids must be >= 0, got {token}")
            _check(math.isfinite(bias) and -100 <= bias <= 100, f"logit_bias values must be in [-100, 100], got {bias}")
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
        )
        derive = object.__setattr__  # frozen: the derived fields are set here only
        derive(self, "greedy", self.temperature < GREEDY_BELOW)
        penalized = self.repetition_penalty not in (0, 1) or self.presence_penalty != 0 or self.frequency_penalty != 0
        derive(self, "penalized", penalized)
        derive(self, "adjusts_logits", penalized or bool(self.logit_bias))
        top_p = self.top_p if 0 < self.top_p < 1 else 1.0
        derive(self, "columns", (self.temperature, self.min_p, self.top_k, top_p))

    def filtered(self, vocab: int) -> bool:
        """Whether a top-k or top-p filter applies to a vocabulary of `vocab` tokens."""
        return 0 < self.top_k < vocab or 0 < self.top_p < 1

    def stop_ids(self, eos_ids: frozenset[int]) -> frozenset[int]:
        """The ids that end the output (without their text): the stop ids asked for, and the model's ends but
        under ignore_eos."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else eos_ids)

    def sample_seed(self, index: int) -> int | None:
        """The seed sample `index` of n draws with: a request of its own with this seed gives its tokens."""
        return None if self.seed is None else (self.seed + index) % 2**64


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


_serials = itertools.count()


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs of one sequence this step. `token_ids` is the sequence's own list, not a copy
    (the step samples before it appends): a decode step's host work must not grow with the context."""

    params: SamplingParams
    seed: int  # the request's seed, or one drawn at arrival
    token_ids: list[int]  # prompt, then output
    num_prompt: int
    banned_ids: list[int] = field(default_factory=list)  # eos / stop ids while below min_new_tokens (read only then)
    num_pending: int = 0  # draws still on the device, not in `token_ids` yet (overlap: never with penalties)
    # This process's number for it, never given twice: what a `SampleTable` knows it by (an id could be reused)
    serial: int = field(default_factory=lambda: next(_serials), init=False, repr=False, compare=False)

    @property
    def num_output(self) -> int:
        """Draws so far: this step's draw is number `num_output` of the row's seed."""
        return len(self.token_ids) - self.num_prompt + self.num_pending


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]  # (chosen, top-n) per row


@dataclass(frozen=True, slots=True)
class StepParams:
    """The sampling parameters of a draw's rows, in row order (`SampleTable.gathered`)."""

    columns: np.ndarray  # [4, rows]: (temperature, min_p, top_k, top_p), `SamplingParams.columns`
    seeds: np.ndarray
    greedy: np.ndarray
    any_greedy: bool
    wanted: list[int]  # the rows that ask for logprobs
    adjusts: bool  # a row's logits change before it draws: penalties, a logit bias, banned ids
    # `filters`' results, by (vocabulary, device): made at the first draw, read by every draw of the same rows
    _filters: dict[tuple[int, torch.device], "RowFilters"] = field(default_factory=dict, compare=False)
    # `uniforms`' draws ahead: (the counters they start from, [DRAWS_AHEAD, rows] draws from there)
    _ahead: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list, compare=False)
    _plain: dict[int, bool] = field(default_factory=dict, compare=False)  # `plain`'s, by vocabulary

    def plain(self, vocab: int) -> bool:
        """Whether every row draws at its temperature alone: none greedy, none asking for logprobs, no logit
        changed before the draw, no min-p, top-k or top-p. Such a step's sampling is the same few operations
        on the same shapes whatever its rows (`draw_at_temperature`), which a CUDA graph can replay."""
        known = self._plain.get(vocab)
        if known is None:
            _, min_p, top_k, top_p = self.columns
            known = self._plain[vocab] = not (
                self.any_greedy or self.wanted or self.adjusts or min_p.any() or _filtered(top_k, top_p, vocab).any()
            )
        return known

    def filters(self, vocab: int, device: torch.device) -> "RowFilters":
        """The rows that sample (every row, or those not greedy) as the draw reads them, made once for as long
        as a step draws for the same rows (`SampleTable.gathered`), not at every step."""
        made = self._filters.get((vocab, device))
        if made is None:
            sampled = np.flatnonzero(~self.greedy) if self.any_greedy else None
            columns = self.columns if sampled is None else self.columns[:, sampled]
            made = self._filters[(vocab, device)] = _row_filters(columns, vocab, device, sampled)
        return made

    def uniforms(self, counters: np.ndarray) -> np.ndarray:
        """Each row's `uniform` at its counter (a draw's, `SampleTable.draw`), as float32. Made DRAWS_AHEAD
        draws at a time: every draw of the same rows (the same `StepParams`) moves each row's counter on by one,
        so the draws of the steps ahead are known now, and a step reads its column rather than make its own
        (a dozen array operations, each slow on the caches a CPU forward leaves)."""
        if self._ahead:
            start, ahead = self._ahead[0]
            step = int(counters[0] - start[0]) if len(counters) else 0
            if 0 <= step < DRAWS_AHEAD:
                return ahead[step]
        ahead = uniforms(self.seeds[None, :], counters[None, :] + np.arange(DRAWS_AHEAD, dtype=np.int64)[:, None])
        self._ahead[:] = [(counters, ahead)]
        return ahead[0]


class SampleTable:
    """The sampler's per-row state, kept across steps in arrays: a step reads its rows' parameters, seeds and
    draw counters by slot, in array operations, instead of from hundreds of rows in Python.

    A slot belongs to one `SampleRow` (a sequence keeps its row for life, so a row seen before is found by its
    serial) and is written when the row first draws: its parameters and seed never change, and its draw
    counter moves by one per draw, here, as the row's own count does (a token drawn is appended, or pending on
    the device). Once every slot is taken, those no draw used in this call are freed together (the rows of
    ended sequences among them), and where that is not enough the table grows. A steady decode step draws for
    the same rows in the same order as the step before: it finds their slots, and the parameters gathered from
    them (`gathered`), as that step left them."""

    def __init__(self, capacity: int = 64) -> None:
        # (temperature, min_p, top_k, top_p) as the sampler applies them (`SamplingParams.columns`), in float64
        self.columns = np.zeros((4, capacity), dtype=np.float64)
        self.seeds = np.zeros(capacity, dtype=np.uint64)
        # Draws so far: the next draw's counter (`uniform`); the last call's rows' are in `_next` (`draw`)
        self.drawn = np.zeros(capacity, dtype=np.int64)
        self.greedy = np.zeros(capacity, dtype=bool)
        self.logprobs = np.zeros(capacity, dtype=np.int64)  # `SamplingParams.logprobs`
        # Logits changed before drawing: penalties, a logit bias, or ids banned below min_new_tokens
        self.adjusts = np.zeros(capacity, dtype=bool)
        self._slots: dict[int, int] = {}  # a row's serial -> its slot
        self._serials = np.full(capacity, -1, dtype=np.int64)  # each slot's row, -1 where free
        self._used = np.zeros(capacity, dtype=np.int64)  # the draw call that last used each slot
        self._calls = 0
        self._free = list(range(capacity - 1, -1, -1))
        self._last: tuple[list[SampleRow], np.ndarray] = ([], np.zeros(0, dtype=np.int64))  # the last call's
        self._next = np.zeros(0, dtype=np.int64)  # the counters of the last call's rows' next draws (`draw`)
        self._gathered: tuple[np.ndarray, StepParams] | None = None

    @property
    def capacity(self) -> int:
        return len(self._serials)

    def draw(self, rows: list[SampleRow]) -> tuple[np.ndarray, np.ndarray]:
        """The rows' slots, and the counter of the draw each makes now, counted as made. The slots array is the
        table's (the same object while the rows are): read it, never write it. While a call draws for the same
        rows as the one before, their counters move on in `_next` alone, and reach `drawn` and `_used` when
        other rows come: a step's fancy-indexed reads and writes, slow on the caches a CPU forward leaves, are
        saved."""
        self._calls += 1
        last_rows, at = self._last
        if len(rows) != len(last_rows) or not all(map(operator.is_, rows, last_rows)):
            self.drawn[at], self._used[at] = self._next, self._calls - 1  # the last rows' state, written back
            at = self._slots_of(rows)
            self._last = (rows, at)  # held: no row of it is freed, so none's serial is reused meanwhile
            self._used[at] = self._calls
            self._next = self.drawn[at]
        counters, self._next = self._next, self._next + 1
        return at, counters

    def _slots_of(self, rows: list[SampleRow]) -> np.ndarray:
        get = self._slots.get
        slots = [get(row.serial, -1) for row in rows]
        if -1 in slots:
            known = np.array([s for s in slots if s >= 0], dtype=np.int64)
            self._used[known] = self._calls  # this call's: never freed to make room for its other rows
            slots = [self._slot(row) if slot < 0 else slot for row, slot in zip(rows, slots)]
        return np.array(slots, dtype=np.int64)

    def gathered(self, at: np.ndarray) -> StepParams:
        """The parameters of the rows at slots `at` (a `draw`'s), gathered once for as long as the same array
        comes back: a slot's parameters never change while it is taken."""
        if self._gathered is None or self._gathered[0] is not at:
            greedy = self.greedy[at]
            params = StepParams(
                self.columns[:, at],
                self.seeds[at],
                greedy,
                bool(greedy.any()),
                np.flatnonzero(self.logprobs[at]).tolist(),
                bool(self.adjusts[at].any()),
            )
            self._gathered = (at, params)
        return self._gathered[1]

    def _slot(self, row: SampleRow) -> int:
        """A row this call did not find: written into a slot of its own (once, should it come twice)."""
        slot = self._slots.get(row.serial)
        if slot is not None:
            return slot
        if not self._free:
            self._free_stale()
        if not self._free:
            self._grow()
        slot = self._free.pop()
        params = row.params
        self.columns[:, slot] = params.columns
        self.seeds[slot] = row.seed
        self.drawn[slot] = row.num_output
        self.greedy[slot] = params.greedy
        self.logprobs[slot] = params.logprobs
        self.adjusts[slot] = params.adjusts_logits or params.min_new_tokens > 0
        self._used[slot] = self._calls
        self._serials[slot] = row.serial
        self._slots[row.serial] = slot
        return slot

    def _free_stale(self) -> None:
        stale = np.flatnonzero((self._used < self._calls) & (self._serials >= 0))
        for serial in self._serials[stale].tolist():
            del self._slots[serial]
        self._serials[stale] = -1
        self._free += stale.tolist()

    def _grow(self) -> None:
        old = self.capacity
        for name in ("columns", "seeds", "drawn", "greedy", "logprobs", "adjusts", "_used", "_serials"):
            array = getattr(self, name)
            grown = np.full((*array.shape[:-1], 2 * old), -1 if name == "_serials" else 0, dtype=array.dtype)
            grown[..., :old] = array
            setattr(self, name, grown)
        self._free = list(range(2 * old - 1, old - 1, -1))


DRAWS_AHEAD = 16  # `StepParams.uniforms`: each row's draws made this many steps at a time

_MASK64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's constants


def uniform(seed: int, counter: int) -> float:
    """The counter-th draw in [0, 1) of a seed's stream (SplitMix64's mix of seed + counter * golden ratio),
    with 24 bits so that it is exact in float32. A function of its arguments only: a row's draw never depends
    on the batch, the device, or the draws of other rows."""
    z = (seed + (counter + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return ((z ^ (z >> 31)) >> 40) * 2.0**-24


def uniforms(seeds: list[int] | np.ndarray, counters: list[int] | np.ndarray) -> np.ndarray:
    """`uniform` of each (seed, counter), as float32, in uint64 arithmetic (which wraps as `& _MASK64` does):
    a step's hundreds of rows in a few array operations instead of a Python loop."""
    u64 = np.uint64
    z = np.array(seeds, dtype=u64) + (np.array(counters, dtype=u64) + u64(1)) * u64(_GOLDEN)
    z = (z ^ (z >> u64(30))) * u64(_MIX1)
    z = (z ^ (z >> u64(27))) * u64(_MIX2)
    return ((z ^ (z >> u64(31))) >> u64(40)).astype(np.float32) * np.float32(2.0**-24)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """`launch_sample`, waiting for its result."""
    return launch_sample(logits, rows).result()


def launch_sample(
    logits: torch.Tensor,
    rows: list[SampleRow],
    masks: tuple[torch.Tensor, list[int]] | None = None,
    table: SampleTable | None = None,
    scratch: bool = False,
    plain: Callable[[np.ndarray, np.ndarray], torch.Tensor] | None = None,
) -> "SampleFuture":
    """logits: [rows, vocab] fp32 on the model's device, which does all the work; the chosen ids (and the
    logprobs asked for) come back to the host in one copy, queued here and read by `SampleFuture.result`.
    Each row's result depends only on that row, so a seeded request gives the same tokens whatever else shares
    its batch. `masks`: the constrained rows' token bitmask and their row numbers (`TokenMasks.fill`), applied
    first; raw logprobs are of the model's distribution, before the masks as before the penalties, processed ones
    of the distribution each row draws from (`step_logprobs`). `table`: the rows' state kept across steps (a
    model runner's); without one, a table of this call's rows. `scratch`: the logits are the caller's to overwrite
    (a step's own): where no row reads log-probabilities from them, the temperature divides them in place, not
    into a new [rows, vocabulary] tensor (on a CPU, whose fresh pages cost more than the division: 100 against
    150-180 ms with softmax at 256 rows of Qwen's 151,936 ids). `plain`: where every row draws at its
    temperature alone (`StepParams.plain`) and the logits are scratch, what draws them, given their
    temperatures and uniforms: a CUDA graph of `draw_at_temperature` over these logits (`DecodeGraphs.draw`),
    one launch for a few dozen."""
    table = table if table is not None else SampleTable(max(len(rows), 1))
    at, counters = table.draw(rows)
    step = table.gathered(at)
    if plain is not None and scratch and masks is None and len(rows) and step.plain(logits.shape[-1]):
        tokens = plain(step.columns[0], step.uniforms(counters))
        return SampleFuture(tokens, tokens, rows, [])
    raw = logits
    if masks is not None:
        logits = apply_token_mask(logits.clone(), *masks)
    if step.adjusts:
        logits = _apply_penalties(logits, rows)
    greedy, wanted = step.greedy, step.wanted
    if len(rows) and not step.any_greedy:  # no greedy rows: no argmax, no scatter
        filters = step.filters(logits.shape[-1], logits.device)
        tokens = _sample_rows(logits, filters, step.uniforms(counters), in_place=scratch and not wanted)
        return _fetch(raw, logits, tokens, rows, wanted)
    tokens = torch.ops.lmgate.argmax_rows(logits) if layer_kernels(logits) else logits.argmax(dim=-1)
    if not greedy.all():
        filters = step.filters(logits.shape[-1], logits.device)
        assert filters.sampled is not None, "the rows that are not greedy"
        sampled, idx = filters.sampled
        tokens[idx] = _sample_rows(logits[idx], filters, step.uniforms(counters)[sampled], in_place=True)  # a copy
    return _fetch(raw, logits, tokens, rows, wanted)


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Logit bias; repetition penalty over prompt and output (as Hugging Face and vLLM); presence / frequency
    over output; banned ids to -inf. Each kind is one indexed update over all its rows' (row, token) pairs, the
    penalties' found in array operations (a row's history is hundreds of tokens or more)."""
    if not any(r.params.adjusts_logits or r.banned_ids for r in rows):
        return logits
    logits = logits.clone()
    device, vocab = logits.device, logits.shape[-1]

    def pairs(token_lists: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        row_idx = [i for i, ids in token_lists for _ in ids]
        tok_idx = [t for _, ids in token_lists for t in ids]
        at = torch.from_numpy(np.array([row_idx, tok_idx], dtype=np.int64))  # numpy reads the ints faster
        row_at, tok_at = to_device(at, device).unbind()
        return row_at, tok_at

    def distinct(token_lists: list[tuple[int, list[int]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each (row, token) pair once, in row then token order, with how often it came: in array operations,
        not a Python list a token."""
        keys = np.concatenate([np.array(ids, dtype=np.int64) + i * vocab for i, ids in token_lists])
        keys, counts = np.unique(keys, return_counts=True)
        return keys // vocab, keys % vocab, counts

    def on_device(*arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
        return tuple(to_device(torch.from_numpy(a), device) for a in arrays)

    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if biased:
        at = pairs([(i, [t for t, _ in bias]) for i, bias in biased])
        values = torch.tensor([b for _, bias in biased for _, b in bias], dtype=logits.dtype)
        logits.index_put_(at, to_device(values, device), accumulate=True)

    repeat = [(i, r.token_ids) for i, r in enumerate(rows) if r.params.repetition_penalty not in (0, 1)]
    if repeat:
        row_of, tokens, _ = distinct(repeat)
        # float32, as the logits; past its largest float32 holds inf, and a logit of 0 x inf is NaN
        penalties = np.array([r.params.repetition_penalty for r in rows], dtype=np.float64)
        penalty, at_row, at_token = on_device(
            np.minimum(penalties[row_of], np.finfo(np.float32).max).astype(np.float32), row_of, tokens
        )
        vals = logits[at_row, at_token]
        logits[at_row, at_token] = torch.where(vals > 0, vals / penalty, vals * penalty).clamp_(
            -PENALIZED_LIMIT, PENALIZED_LIMIT
        )
    counted = [
        (i, r.token_ids[r.num_prompt :])
        for i, r in enumerate(rows)
        if (r.params.presence_penalty or r.params.frequency_penalty) and r.num_output
    ]
    if counted:
        # Only where a token came out, each once with its count, rather than [rows, vocabulary] counts a step:
        # the same float32 frequency x count + presence at those tokens, and nothing elsewhere.
        row_of, tokens, counts = distinct(counted)
        freq = np.array([r.params.frequency_penalty for r in rows], dtype=np.float32)[row_of]
        presence = np.array([r.params.presence_penalty for r in rows], dtype=np.float32)[row_of]
        penalty, at_row, at_token = on_device(freq * counts.astype(np.float32) + presence, row_of, tokens)
        logits[at_row, at_token] -= penalty
    banned = [(i, r.banned_ids) for i, r in enumerate(rows) if r.banned_ids]
    if banned:
        logits[pairs(banned)] = float("-inf")
    return logits


@dataclass(frozen=True, slots=True)
class RowFilters:
    """The parameters of the rows that sample, as the device reads them (`StepParams.filters`)."""

    # Each [rows, 1] float32: temperature, min_p, top_k (the vocabulary where off), top_p
    columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    min_p: bool  # a row has a min-p: else its three passes over the vocabulary are saved
    filtered: str  # which rows have a top-k or top-p: "none", "all" or "some"
    known: bool  # every such row's top-k lies among its candidates, whatever the probabilities
    split: tuple[torch.Tensor, torch.Tensor] | None  # "some": the rows without a filter, those with, on the device
    sampled: tuple[np.ndarray, torch.Tensor] | None  # where greedy rows do not sample: the others, host and device


def _row_filters(params: np.ndarray, vocab: int, device: torch.device, sampled: np.ndarray | None = None) -> RowFilters:
    """`params`: the rows' [4, rows] (temperature, min_p, top_k, top_p), in float64 as they were given (a top_p
    just below 1 is 1 in float32, and still filters), which is where the rows that filter are found. They cross
    to the device in one copy (float32 holds each exactly: top-k below 2^24)."""
    temperature, min_p, top_k, top_p = params
    filtered = _filtered(top_k, top_p, vocab)
    top_k = np.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    columns = to_device(torch.from_numpy(np.stack([temperature, min_p, top_k, top_p]).astype(np.float32)), device)
    known = top_k <= min(CANDIDATES, vocab)
    split = None
    if filtered.any() and not filtered.all():
        plain, kept = np.flatnonzero(~filtered), np.flatnonzero(filtered)
        order = to_device(torch.from_numpy(np.concatenate([plain, kept])), device)
        split = order[: len(plain)], order[len(plain) :]
    temps, min_ps, top_ks, top_ps = columns.unsqueeze(2)
    return RowFilters(
        (temps, min_ps, top_ks, top_ps),
        bool(min_p.any()),
        "some" if split is not None else "all" if filtered.any() else "none",
        bool(known[filtered].all()),
        split,
        None if sampled is None else (sampled, to_device(torch.from_numpy(sampled), device)),
    )


def _filtered(top_k: np.ndarray, top_p: np.ndarray, vocab: int) -> np.ndarray:
    """The rows a top-k or top-p filter applies to (`SamplingParams.filtered`), of their parameter columns."""
    return ((top_k > 0) & (top_k < vocab)) | (top_p < 1)


def draw_at_temperature(logits: torch.Tensor, temps: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """The whole sampling of rows that draw at their temperature alone (`StepParams.plain`), `logits` divided
    in place: the operations `_sample_rows` makes for them, so a graph of these draws the same tokens.
    `temps`, `draws`: [rows, 1] float32."""
    return _draw(torch.softmax(_scaled(logits, temps, in_place=True), dim=-1), draws)


def _scaled(logits: torch.Tensor, temps: torch.Tensor, in_place: bool) -> torch.Tensor:
    """The logits over each row's temperature; `in_place`: into `logits` itself, where it is float32 (else the
    division is in float32, as it always is)."""
    if in_place and logits.dtype == temps.dtype:
        with torch.inference_mode():  # a model's logits are inference tensors, written only in that mode
            return logits.div_(temps)
    return logits / temps


def _sample_rows(
    logits: torch.Tensor, filters: RowFilters, uniform_draws: np.ndarray, in_place: bool = False
) -> torch.Tensor:
    """Temperature, then the filters in vLLM's order, each over what the one before kept: min-p, top-k, top-p;
    then one uniform draw per row (`uniform_draws`: `uniform` of its seed and draw counter, computed on the host,
    24 bits: exact in float32) against the row's cumulative distribution. `in_place`: the temperature may divide
    `logits` itself."""
    temps, min_ps, top_ks, top_ps = filters.columns  # each [rows, 1]
    # Made [rows, 1] by numpy: a torch call lets go of the GIL, and the loop waits to take it back
    draws = to_device(torch.from_numpy(uniform_draws.reshape(-1, 1)), logits.device)
    probs = torch.softmax(_scaled(logits, temps, in_place), dim=-1)
    if filters.min_p:
        probs = probs.masked_fill(probs < min_ps * probs.amax(dim=-1, keepdim=True), 0.0)
    if filters.filtered == "none":
        return _draw(probs, draws)
    if filters.split is None:
        return _top_k_top_p(probs, top_ks, top_ps, draws, filters.known)
    # A row without top-k or top-p draws over the unsorted vocabulary whatever its batch holds: the same
    # draw over the filters' sorted order would pick another token.
    at_plain, at_filtered = filters.split
    tokens = torch.empty(len(uniform_draws), dtype=torch.long, device=logits.device)
    tokens[at_plain] = _draw(probs[at_plain], draws[at_plain])
    tokens[at_filtered] = _top_k_top_p(
        probs[at_filtered], top_ks[at_filtered], top_ps[at_filtered], draws[at_filtered], filters.known
    )
    return tokens


def _top_k_top_p(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, draws: torch.Tensor, known: bool
) -> torch.Tensor:
    """Rows that each have a top-k or a top-p: top-k keeps the k most likely tokens, then top-p the most likely
    of those until their share of what top-k (and min-p before it) kept reaches p."""
    vocab = probs.shape[-1]
    # The filters keep tokens in order of probability. Most rows keep few: their top CANDIDATES, found
    # without sorting the vocabulary, hold every token they keep (a top-k within them, or a nucleus whose
    # mass they reach). Only other rows sort it all. Which path a row takes depends on that row alone.
    candidates = min(CANDIDATES, vocab)
    top = probs.topk(candidates, dim=-1)
    mass = _block_sums(probs).sum(dim=-1, keepdim=True)  # 1, less what min-p dropped
    nucleus = (top_ps < 1) & (top_ks >= vocab) & (top.values.sum(dim=-1, keepdim=True) >= top_ps * mass)
    inside = ((top_ks <= candidates) | nucleus).squeeze(1)
    tokens = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    # `known`: every row's top-k lies among its candidates, as the host knows from the parameters alone; then
    # the device is not asked (a question that waits for it, which overlap scheduling must not; top-p rows ask).
    for where, values, order in _split(inside, top, probs, known):
        width = values.shape[-1]
        ranks = torch.arange(width, device=probs.device).unsqueeze(0)
        kept = values.masked_fill(ranks >= top_ks[where], 0.0)
        # What top-k kept: all of it lies in `values`, but a nucleus row's candidates hold only part of it.
        total = torch.where(top_ks[where] <= width, kept.sum(dim=-1, keepdim=True), mass[where])
        kept = kept.masked_fill((kept.cumsum(dim=-1) - kept) >= top_ps[where] * total, 0.0)
        tokens[where] = order.gather(1, _draw(kept, draws[where]).unsqueeze(1)).squeeze(1)
    return tokens


CANDIDATES = 256  # tokens a row's top-k / top-p looks at before it sorts the whole vocabulary
DRAW_BLOCK = 1024  # tokens a draw's second search scans: the first finds the block among block sums


def _split(inside: torch.Tensor, top, probs: torch.Tensor, all_inside: bool):
    """(rows, sorted probabilities, their token ids) for the rows whose candidates suffice, then for the rest."""
    if all_inside or bool(inside.all()):
        yield slice(None), top.values, top.indices
        return
    rest = ~inside
    if bool(inside.any()):
        yield inside, top.values[inside], top.indices[inside]
    values, order = probs[rest].sort(dim=-1, descending=True)
    yield rest, values, order


def _draw(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Per row, the index at which the cumulative distribution passes draw x total. In two searches, each
    over a short prefix sum: the block where it passes (of the block sums), then the token within that block.
    A prefix sum over a whole vocabulary of 150k tokens is a slow scan on a GPU, and a long one on a CPU."""
    vocab = probs.shape[-1]
    if vocab <= DRAW_BLOCK:
        return _search(probs, draws)[0]
    sums = _block_sums(probs)
    block, cdf, target = _search(sums, draws)  # a block of non-zero mass
    at = block.unsqueeze(1)
    into = (target - (cdf - sums).gather(1, at)) / sums.gather(1, at)  # of the block's mass, below 1 (`_search`)
    into = into.clamp_(0.0, 1 - torch.finfo(into.dtype).eps / 2)
    ids = at * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=probs.device)
    inside = probs.gather(1, ids.clamp(max=vocab - 1)).masked_fill(ids >= vocab, 0.0)
    return (block * DRAW_BLOCK + _search(inside, into)[0]).clamp_(max=vocab - 1)


def _block_sums(probs: torch.Tensor) -> torch.Tensor:
    """Each row's sums over blocks of DRAW_BLOCK tokens. Also the way to a row's total that does not depend on
    the batch: torch splits one long sum over threads, but sums each of many short ones in one thread."""
    rows, vocab = probs.shape
    whole = vocab - vocab % DRAW_BLOCK
    sums = probs[:, :whole].view(rows, -1, DRAW_BLOCK).sum(dim=-1)  # a view: no copy of the probabilities
    if whole < vocab:
        sums = torch.cat([sums, probs[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    return sums


def _search(probs: torch.Tensor, draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The index per row, and the prefix sums and target it was found by. Each draw is at most the largest
    float below 1 (a `uniform` has 24 bits; a share within a block is clamped there), so draw x total rounds to
    below the total for any total above the smallest normal float: a distribution's holds its largest
    probability, and a block of less mass is found only by a draw of 0. The target then lands on a token of
    non-zero probability with no guard (three array operations a step fewer)."""
    cdf = probs.cumsum(dim=-1)
    target = draws * cdf[:, -1:]
    # A row of NaN (a model that overflowed) finds no token: the last id, not one past the vocabulary.
    found = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    return found, cdf, target


def _fetch(
    raw: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow], wanted: list[int]
) -> "SampleFuture":
    """The chosen ids, and for the rows that ask (`wanted`), the chosen token's logprob and the top n (of the raw
    or the processed distribution: `step_logprobs`, from the model's logits or the masked and penalized ones),
    packed into one float64 tensor (ids are exact there) for a single device-to-host copy."""
    if not wanted:
        return SampleFuture(tokens, tokens, rows, wanted)
    idx = to_device(torch.tensor(wanted), raw.device)
    lp = step_logprobs(raw, logits, tokens, idx, [rows[i].params for i in wanted])
    chosen = lp.gather(1, tokens[idx].unsqueeze(1))
    top = lp.topk(max(rows[i].params.logprobs for i in wanted), dim=-1)
    packed = torch.cat(
        [tokens.double(), chosen.double().flatten(), top.indices.double().flatten(), top.values.double().flatten()]
    )
    return SampleFuture(tokens, packed, rows, wanted)


class SampleFuture:
    """A step's draws on their way to the host. `tokens` stays on the device, where the next step's inputs
    take it from before the host has read it (overlap scheduling); `result` waits for the copy."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor, rows: list[SampleRow], wanted: list[int]) -> None:
        self.tokens = tokens
        self._rows, self._wanted = rows, wanted
        self._copied: torch.cuda.Event | None = None
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
            packed = host
        self._packed = packed
        self.known: SampleResult | None = None  # `result`, once it has been read

    def result(self) -> SampleResult:
        """The ids as Python ints, and each asking row's logprobs; the first call waits for the device (the GIL
        let go)."""
        if self.known is None:
            self.known = self._read()
        return self.known

    def _read(self) -> SampleResult:
        if self._copied is not None:
            self._copied.synchronize()
        rows, wanted, packed = self._rows, self._wanted, self._packed
        if not wanted:
            return SampleResult(packed.tolist(), [None] * len(rows))
        n, w = len(rows), len(wanted)
        token_list = [int(t) for t in packed[:n].tolist()]
        chosen_list = packed[n : n + w].tolist()
        top_ids, top_values = packed[n + w :].view(2, w, -1)
        out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * n
        for j, i in enumerate(wanted):
            k = rows[i].params.logprobs
            out[i] = (
                chosen_list[j],
                [(int(t), v) for t, v in zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist())],
            )
        return SampleResult(token_list, out)
