"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from .attention import (AttentionMetadata, DecodeTables, GatheredDecode, PrefillChunk, PrefillTables, decode_mask,
                        gather_rows)
from .models.llama import LlamaForCausalLM
from .sampling import SampleResult, SampleRow, sample
from .sequence import Sequence


@dataclass(slots=True)
class StepInputs:
    """Device-side inputs of one step: a flat token batch, decodes first."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # the batch row of each sampling sequence's last token
    sample_rows: list[SampleRow]


# How attention reads the paged cache: torch ops (gather, then matmuls), the C++ CPU decode kernel
# (engine/kernels), or the Triton kernels (engine/kernels/triton, the CUDA path).
ATTENTION_PATHS = ("torch", "cpu", "triton")


class ModelRunner:
    """Owned by one engine loop's thread, like the KV cache tensors it writes."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        make_kv_cache: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]],
        block_size: int,
        device: torch.device,
        attention: str,
    ) -> None:
        self.model = model  # replaced whole by the engine (weight updates), read once per step
        self.weights_version = 0  # bumped by the engine with every new model, after `model` is replaced
        self.make_kv_cache = make_kv_cache
        self.kv_caches = make_kv_cache()
        self.block_size = block_size
        self.device = device
        self.attention = attention  # of ATTENTION_PATHS; chosen at build, read per step

    def release_kv_cache(self) -> None:
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def allocate_kv_cache(self) -> None:
        if not self.kv_caches:
            self.kv_caches = self.make_kv_cache()

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.kv_caches for t in kv)

    def setup(self, batch: list[Sequence]) -> StepInputs:
        """kSetup: host-side sequence state to device tensors."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        rows: list[SampleRow] = []
        decodes = [s for s in batch if s.num_scheduled == 1 and s.num_uncomputed == 1]
        prefills: list[PrefillChunk] = []
        chunks: list[Sequence] = []
        for seq in batch:
            start, end = seq.num_computed, seq.num_computed + seq.num_scheduled
            first_row = len(ids)
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(seq.block_table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end))
            if seq not in decodes and self.attention == "triton":
                chunks.append(seq)
            elif seq not in decodes:
                table = torch.tensor(seq.block_table[: -(-end // self.block_size)], dtype=torch.long)
                prefills.append(PrefillChunk(first_row, len(ids), end, self._rows(table)))
            if seq.samples_this_step:
                logit_rows.append(len(ids) - 1)
                rows.append(SampleRow(seq.params, seq.generator, seq.token_ids[: seq.num_prompt_tokens], seq.output_ids, seq.banned_ids))
        meta = AttentionMetadata(self._tensor(slots), len(decodes), self._decode_tables(decodes) if decodes else None,
                                 self._prefill_tables(chunks) if self.attention == "triton" else prefills,
                                 triton=self.attention == "triton")
        return StepInputs(self._tensor(ids), self._tensor(positions), meta, self._tensor(logit_rows), rows)

    def _decode_tables(self, decodes: list[Sequence]) -> DecodeTables | GatheredDecode:
        width = max(len(s.block_table) for s in decodes)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in decodes], dtype=torch.long)
        lengths = torch.tensor([s.num_computed + 1 for s in decodes])
        if self.attention != "torch":
            return DecodeTables(tables.to(self.device), lengths.to(self.device))
        return GatheredDecode(self._rows(tables), decode_mask(lengths, width * self.block_size, self.kv_caches[0][0]).to(self.device))

    def _prefill_tables(self, chunks: list[Sequence]) -> PrefillTables:
        """Rows counted from the first prefill row: the chunks follow one another after the decodes."""
        lens = [s.num_scheduled for s in chunks]
        width = max((len(s.block_table) for s in chunks), default=1)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in chunks]
        return PrefillTables(
            self._tensor(tables) if chunks else torch.zeros((0, 1), dtype=torch.long, device=self.device),
            self._tensor([0, *itertools.accumulate(lens)][: len(lens)]), self._tensor(lens),
            self._tensor([s.num_computed + s.num_scheduled for s in chunks]), max(lens, default=0),
        )

    def _rows(self, tables: torch.Tensor) -> torch.Tensor:
        kvh, num_blocks = self.kv_caches[0][0].shape[:2]
        return gather_rows(tables, kvh, num_blocks).to(self.device)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """kForward: the model over the batch; logits only for the rows that sample."""
        model = self.model
        hidden = model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        return model.compute_logits(hidden[inputs.logit_rows])

    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> SampleResult:
        """kFetch: sampling on the host, device results back as Python ints."""
        return sample(logits.cpu(), inputs.sample_rows)
