"""Perplexity of a model over a passage, from one prefill of all of it or one token a step: the measure of an
approximation (`--int8-activations`) that changes a model's numbers, where token equality cannot be asked for.
Read by tests/test_int8_activations.py and benchmarks/bench_quant.py; needs the C++ attention kernel."""

from __future__ import annotations

import math

import torch

from lmgate.engine.models.attention import AttentionMetadata, DecodeTables, PrefillTables
from lmgate.engine.step.kv_cache import allocate_kv_cache

# A passage for perplexity: plain English prose, written for lmgate's tests.
PASSAGE = (
    "The harbour town wakes early. Before the sun clears the hills, the fishing boats are already out past the "
    "breakwater, and the bakery on the corner has its first loaves cooling in the window. By seven the market "
    "square fills with stalls: apples and pears from the valley farms, cheese wrapped in cloth, baskets of eggs, "
    "and bunches of flowers that the children carry home for their grandmothers. The old clock on the town hall "
    "has been five minutes slow for as long as anyone can remember, and nobody has ever wanted it fixed. In the "
    "afternoon the wind turns and blows in from the sea, carrying the smell of salt and seaweed through the narrow "
    "streets. Visitors come in the summer to walk along the cliffs, to swim in the cold water of the bay, and to "
    "eat fried fish from paper cones on the harbour wall. In the winter the town belongs to its own people again. "
    "The cafes close early, the lights in the houses come on at four, and the only sound after dark is the slow "
    "rhythm of the waves against the stones."
)


def perplexity(
    model, ids: list[int], kv_dtype: torch.dtype = torch.float32, block_size: int = 16, decode: bool = False
) -> float:
    """exp of the mean negative log-likelihood of every token of `ids` after the first, over a fresh KV cache of
    `kv_dtype`: as one prefill chunk (many rows at once: the int8 GEMM), or with `decode` one token a step as
    a stream decodes (one row: the int8 matrix-vector product, and a quantized model's fused decode)."""
    n = len(ids)
    blocks = -(-n // block_size)
    kv = allocate_kv_cache(model.config, blocks, block_size, kv_dtype, torch.device("cpu"))
    table = torch.arange(blocks).view(1, -1)
    with torch.inference_mode():
        if decode:
            no_prefill = PrefillTables(
                torch.zeros((0, 1), dtype=torch.long), *(torch.zeros(0, dtype=torch.long),) * 3, 0
            )
            logits = torch.cat(
                [
                    model.compute_logits(
                        model(
                            torch.tensor([ids[i]]),
                            torch.tensor([i]),
                            kv,
                            AttentionMetadata(
                                torch.tensor([i]), 1, DecodeTables(table, torch.tensor([i + 1])), no_prefill
                            ),
                        )
                    )
                    for i in range(n)
                ]
            )
        else:
            chunk = PrefillTables(table, torch.tensor([0]), torch.tensor([n]), torch.tensor([n]), n)
            meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decode=0, decode=None, prefills=chunk)
            logits = model.compute_logits(model(torch.tensor(ids), torch.arange(n), kv, meta))
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:])).item())
