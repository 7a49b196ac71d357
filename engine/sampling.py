"""Sampling parameters (validated at the door) and the batched sampler the model runner calls."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import InvalidRequest

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Zero values mean "off": temperature 0 is greedy, top_k 0 / top_p 0 or 1 / min_p 0 disable the filter."""

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
    skip_special_tokens: bool = True

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
        _check(self.seed is None or 0 <= self.seed < 2**64, f"seed must be in [0, 2^64), got {self.seed}")
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings")
        _check(all(self.stop), "stop strings must not be empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty not in (0, 1) or self.presence_penalty != 0 or self.frequency_penalty != 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs of one sequence this step."""

    params: SamplingParams
    generator: torch.Generator
    prompt_ids: list[int]
    output_ids: list[int]
    banned_ids: list[int] = field(default_factory=list)  # eos / stop ids while below min_new_tokens


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]  # (chosen, top-n) per row


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """logits: [rows, vocab] fp32. Each row's result depends only on that row, so a seeded request gives the
    same tokens whatever else shares its batch."""
    raw = logits
    logits = _apply_penalties(logits, rows)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        tokens[idx] = _sample_rows(logits[idx], [rows[i] for i in sampled])
    token_list = tokens.tolist()
    return SampleResult(token_list, _logprobs(raw, token_list, rows))


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition penalty over prompt and output (as Hugging Face and vLLM); presence / frequency over output."""
    if not any(r.params.penalized or r.banned_ids for r in rows):
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i, r in enumerate(rows):
        p = r.params
        row = logits[i]
        if p.repetition_penalty not in (0, 1):
            seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_ids:
            ids = torch.tensor(r.output_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if r.banned_ids:
            row[r.banned_ids] = float("-inf")
    return logits


def _sample_rows(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p filters, then one uniform draw per row from its own generator
    (a host generator: the draws cross to the logits' device in one copy)."""
    def column(values: list) -> torch.Tensor:
        return torch.tensor(values, device=logits.device).unsqueeze(1)

    temps = column([r.params.temperature for r in rows])
    probs = torch.softmax(logits / temps, dim=-1)
    min_ps = column([r.params.min_p for r in rows])
    probs = probs.masked_fill(probs < min_ps * probs.amax(dim=-1, keepdim=True), 0.0)
    vocab = probs.shape[-1]
    top_ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_ps = [r.params.top_p if 0 < r.params.top_p < 1 else 1.0 for r in rows]
    if min(top_ks) < vocab or min(top_ps) < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        cut = ranks >= column(top_ks)
        cut |= (probs.cumsum(dim=-1) - probs) >= column(top_ps)
        probs = probs.masked_fill(cut, 0.0)
    else:
        order = None
    cdf = probs.cumsum(dim=-1)
    draws = torch.cat([torch.rand(1, generator=r.generator) for r in rows]).to(logits.device).unsqueeze(1)
    choice = torch.searchsorted(cdf, draws * cdf[:, -1:], right=True).clamp_(max=vocab - 1)
    return (choice if order is None else order.gather(1, choice)).squeeze(1)


def _logprobs(raw: torch.Tensor, tokens: list[int], rows: list[SampleRow]):
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs]
    out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(rows)
    if not wanted:
        return out
    lp = torch.log_softmax(raw[torch.tensor(wanted, device=raw.device)], dim=-1)
    for j, i in enumerate(wanted):
        top = lp[j].topk(rows[i].params.logprobs)
        out[i] = (lp[j, tokens[i]].item(), list(zip(top.indices.tolist(), top.values.tolist())))
    return out
