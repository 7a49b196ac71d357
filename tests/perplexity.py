"""Perplexity of a model over a passage, from one prefill of all of it: the measure of an approximation
(`--int8-activations`) that changes a model's numbers, where token equality cannot be asked for. Read by
tests/test_int8_activations.py and tests/bench_quant.py; needs the C++ attention kernel."""
from __future__ import annotations

import math

import torch

from lmgate.engine.attention import AttentionMetadata, PrefillTables
from lmgate.engine.kv_cache import allocate_kv_cache

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


def perplexity(model, ids: list[int], kv_dtype: torch.dtype = torch.float32, block_size: int = 16) -> float:
    """exp of the mean negative log-likelihood of every token of `ids` after the first, as one prefill chunk over
    a fresh KV cache of `kv_dtype` (many rows at once: the case the int8 kernels serve)."""
    n = len(ids)
    blocks = -(-n // block_size)
    kv = allocate_kv_cache(model.config, blocks, block_size, kv_dtype, torch.device("cpu"))
    chunk = PrefillTables(torch.arange(blocks).view(1, -1), torch.tensor([0]), torch.tensor([n]), torch.tensor([n]), n)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decode=0, decode=None, prefills=chunk)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(n), kv, meta))
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:])).item())
