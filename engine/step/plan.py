"""kSetup's output: one step as plain lists, made row by row (`ModelRunner.plan`) or following the step before's
(`InputBatch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling.constraints import GrammarMatcher
from ..sampling.sampler import SampleRow
from ..scheduling.sequence import Sequence


@dataclass(slots=True)
class PromptRows:
    """The prompt positions whose log-probabilities a step computes (`SamplingParams.prompt_logprobs`): each
    row's log-probability of the prompt token after it, and the `top` most likely alternatives."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    top: int = 0
    owners: list[tuple[Sequence, int]] = field(default_factory=list)  # in row order: the sequence, its rows
    result: torch.Tensor | None = None  # per row: the target's logprob, the top ids, their logprobs (float64)


@dataclass(slots=True)
class StepPlan:
    """kSetup's output: one step, decodes first. The same for every tensor-parallel rank, so a leader broadcasts
    it (without what only the leader reads: `sample_rows` and below, `_shared`) and each rank prepares its own
    tensors for its share of the KV heads."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # each token's KV slot in the flattened cache
    logit_rows: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)  # block tables of the decodes
    decode_lengths: list[int] = field(default_factory=list)  # their tokens of KV, this step's included
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # rows [start, end), context, blocks
    pending_inputs: list[tuple[int, int]] = field(default_factory=list)  # (row, row of the last step's draws)
    # Every row's input is the last step's draw of the same row (a followed step under overlap): one copy on the
    # device, no pairs to convert; `pending_inputs` is then empty.
    pending_in_order: bool = False
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) blocks, before the forward
    # Where the plan followed the step before's (`InputBatch`): the same tables, of which these gained a block,
    # (row, its index in the table, block); None: tables to compare with the last step's (`StepTables`).
    table_growth: list[tuple[int, int, int]] | None = None
    # Only the leader reads these (never broadcast): each drawing row's `SampleRow`; the sequences that draw, in
    # that order; the rows among them with a grammar (structured outputs), with its matcher; the sequences that
    # may have filled a block (`BlockManager.cache_full_blocks`); prompt logprobs asked for.
    sample_rows: list[SampleRow] = field(default_factory=list)
    samplers: list[Sequence] = field(default_factory=list)
    constrained: list[tuple[int, GrammarMatcher]] = field(default_factory=list)
    filled: list[Sequence] = field(default_factory=list)
    prompt: PromptRows | None = None
