"""Sampling: its parameters and the batched sampler (sampler.py), and the log-probabilities a step returns with its
draws, raw or processed (logprobs.py).

Sampling runs where the logits are. `ModelRunner.forward` sets the logits of ids past the tokenizer's vocabulary
(an embedding padded past it, as Qwen2.5's) to -inf, so they are never drawn nor offered as alternatives. A
row's draw is `uniform(seed, draw number)`, a counter-based stream (SplitMix64) computed on the host and copied
in with the other per-row parameters: it depends on nothing but the row, so a seeded request draws the same in
any batch, on any device, after a preemption; its tokens are the same where its logits are: on the CPU (each
row's sums run in one order at any batch size) and on CUDA in float32, both tested; in bfloat16 cuBLAS may pick
another kernel for another batch size, and a row's logits can then differ in their last bits (not yet measured
on a GPU). The path a row's draw takes is the row's own too: a row without top-k or top-p draws over the
unsorted vocabulary even in a batch whose other rows sort theirs (the same draw over a sorted order is another
token). The filters follow vLLM's order, each over what the one before kept: min-p, top-k, then top-p of top-k's
mass. A temperature below `GREEDY_BELOW` (1e-5) is greedy: dividing by it would overflow the logits.
"""
