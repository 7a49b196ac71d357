"""The log-probabilities a step returns with its draws, per row that asks (`SamplingParams.logprobs`): of the
model's distribution ("raw") or of the one the row's token was drawn from ("processed").

Raw: log-softmax of the model's logits, before logit_bias, penalties, structured outputs' mask, temperature
and the filters (what a trainer recomputes from the same weights). Processed: the sampler's own steps
(sampler.py), in its order, over the whole vocabulary: logit_bias, penalties, banned ids and the mask (the
logits the sampler draws from), divided by the temperature (1 for a greedy row), then min-p, top-k and top-p
of top-k's mass; renormalized, with -inf for every token they removed. The token drawn is always kept: where
float rounding at a filter's edge (a top-p boundary, a tie at the k-th place) decides otherwise here than in the
draw's own pass, the draw's decision stands, so a drawn token never has -inf.

Only rows that ask for processed log-probabilities pay for them (a sort of the vocabulary where they filter);
nothing here waits for the device (overlap scheduling).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..machine.transfers import to_device

if TYPE_CHECKING:
    from .sampler import SamplingParams

LOGPROBS_MODES = ("raw", "processed")


def step_logprobs(
    raw: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, idx: torch.Tensor, params: list[SamplingParams]
) -> torch.Tensor:
    """[len(idx), vocab] log-probabilities of the rows `idx` (on the device) whose `params` these are: raw ones
    from `raw`, the model's logits; processed ones from `logits`, those the sampler drew `tokens` from."""
    processed = [j for j, p in enumerate(params) if p.logprobs_mode == "processed"]
    if not processed:  # the common case: as cheap as before there were modes
        return torch.log_softmax(raw[idx], dim=-1)
    if len(processed) == len(params):
        return processed_logprobs(logits[idx], tokens[idx], params)
    plain = [j for j, p in enumerate(params) if p.logprobs_mode != "processed"]
    order = to_device(torch.tensor(plain + processed), idx.device)  # positions in `idx`: raw rows, then the rest
    at_plain, at_processed = order[: len(plain)], order[len(plain) :]
    lp = torch.empty((len(params), raw.shape[-1]), dtype=raw.dtype, device=raw.device)
    lp[at_plain] = torch.log_softmax(raw[idx[at_plain]], dim=-1)
    rows = idx[at_processed]
    lp[at_processed] = processed_logprobs(logits[rows], tokens[rows], [params[j] for j in processed])
    return lp


def processed_logprobs(logits: torch.Tensor, chosen: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Log-probabilities of the distribution each row drew `chosen` from (see the module's docstring), from the
    logits the sampler drew from ([rows, vocab]: biased, penalized, masked). The filters' decisions are the
    sampler's, on the same float32 probabilities: min-p against the row's most likely token, top-k by rank,
    top-p on the exclusive prefix sum of what top-k kept."""
    vocab = logits.shape[-1]
    host = np.array(
        [
            (
                1.0 if p.greedy else p.temperature,
                p.min_p,
                p.top_k if 0 < p.top_k < vocab else vocab,
                p.top_p if 0 < p.top_p < 1 else 1.0,
            )
            for p in params
        ],
        dtype=np.float32,
    ).reshape(-1, 4)
    temps, min_ps, top_ks, top_ps = to_device(torch.from_numpy(np.ascontiguousarray(host.T)), logits.device).unsqueeze(
        2
    )
    scaled = logits / temps
    if not any(p.min_p or p.filtered(vocab) for p in params):
        return torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(scaled, dim=-1)
    removed = probs < min_ps * probs.amax(dim=-1, keepdim=True)  # min-p 0 removes nothing
    if any(p.filtered(vocab) for p in params):
        values, order = probs.masked_fill(removed, 0.0).sort(dim=-1, descending=True)
        past_k = torch.arange(vocab, device=logits.device).unsqueeze(0) >= top_ks
        values = values.masked_fill(past_k, 0.0)
        total = values.sum(dim=-1, keepdim=True)  # what min-p and top-k kept
        past_p = (top_ps < 1) & ((values.cumsum(dim=-1) - values) >= top_ps * total)
        removed |= torch.zeros_like(removed).scatter_(1, order, past_k | past_p)
    removed.scatter_(1, chosen.unsqueeze(1), False)  # the draw's decision stands (the module's docstring)
    return scaled.masked_fill(removed, float("-inf")).log_softmax(dim=-1)
