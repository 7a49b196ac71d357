"""The batched sampler (engine/sampling/sampler.py) on tensors: penalties against transformers' logits processors,
draws that depend on the row alone (seed and draw number), filters that hold, logprobs, and the same tokens
on CUDA as on the CPU where a GPU is present."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from lmgate.engine.sampling import sampler as sampling
from lmgate.engine.sampling.sampler import SampleRow, SampleTable, SamplingParams, sample, uniform, uniforms

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 64


def logits_for(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def row(
    seed: int = 0, output: list[int] | None = None, prompt: list[int] | None = None, banned=(), **params
) -> SampleRow:
    prompt = prompt or [1, 2, 3]
    return SampleRow(SamplingParams(**params), seed, prompt + (output or []), len(prompt), list(banned))


def test_uniform_is_a_function_of_seed_and_counter():
    draws = [uniform(7, c) for c in range(20000)]
    assert draws == [uniform(7, c) for c in range(20000)]
    assert all(0 <= u < 1 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert sum(a < 0.1 for a in draws) / len(draws) == pytest.approx(0.1, abs=0.01)
    assert draws[:50] != [uniform(8, c) for c in range(50)]
    assert uniform(2**64 - 1, 0) < 1  # the largest seed the API takes


def test_a_steps_draws_in_arrays_are_uniforms_own():
    """The sampler draws a step's rows in uint64 arrays: the same bits as `uniform`, for seeds across the whole
    range (a wrap past 2^64 included) and counters far into a stream."""
    rng = random.Random(3)
    seeds = [rng.getrandbits(64) for _ in range(2000)] + [0, 2**63, 2**64 - 1]
    counters = [rng.randrange(10**7) for _ in seeds]
    assert uniforms(seeds, counters).tolist() == [uniform(s, c) for s, c in zip(seeds, counters)]


def test_draws_made_ahead_are_each_steps_own():
    """A step of the same rows as the step before reads its draws from those made ahead (`StepParams.uniforms`):
    at every step, through more steps than are made at once and a change of rows, each row's draw is `uniform`
    of its seed at its counter."""
    rng = random.Random(5)
    pool = [SampleRow(SamplingParams(temperature=0.7), rng.getrandbits(64), [1, 2], 2) for _ in range(6)]
    table, rows = SampleTable(8), pool[:4]
    for step in range(3 * sampling.DRAWS_AHEAD + 5):
        if step == sampling.DRAWS_AHEAD + 3:
            rows = pool[2:]
        at, counters = table.draw(rows)
        drawn = table.gathered(at).uniforms(counters).tolist()
        assert drawn == [uniform(r.seed, c) for r, c in zip(rows, counters.tolist())]
        assert counters.tolist() == [r.num_output for r in rows]
        for r in rows:
            r.token_ids.append(0)


def test_penalties_match_transformers_and_the_presence_frequency_formula():
    logits = logits_for(4)
    rows = [
        row(prompt=[1, 5, 9], output=[9, 9, 20], repetition_penalty=1.3),
        row(output=[4, 4, 4, 7], presence_penalty=0.5, frequency_penalty=0.25),
        row(),
        row(output=[11], banned=[0, 2], repetition_penalty=0.8, frequency_penalty=-1.0),
    ]
    got = sampling._apply_penalties(logits, rows)
    want = logits.clone()
    for i in (0, 3):
        ids = torch.tensor([rows[i].token_ids])
        want[i : i + 1] = RepetitionPenaltyLogitsProcessor(rows[i].params.repetition_penalty)(ids, want[i : i + 1])
    for i in (1, 3):
        counts = torch.bincount(torch.tensor(rows[i].token_ids[rows[i].num_prompt :]), minlength=VOCAB).float()
        want[i] -= rows[i].params.frequency_penalty * counts + rows[i].params.presence_penalty * (counts > 0).float()
    want[3, [0, 2]] = float("-inf")
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(logits, logits_for(4))  # the caller's logits are left alone


def test_penalties_over_random_rows_equal_the_dense_formulas_bit_for_bit():
    """Rows of random histories with every mix of repetition, presence and frequency penalties (extreme ones
    among them), applied to the (row, token) pairs that occur: each logit equals what the formulas give over
    the whole [rows, vocabulary], as floats of the same float32 operations."""
    rng = random.Random(3)
    for case in range(200):
        vocab, n = rng.choice([7, 64, 1000]), rng.randint(1, 5)
        rows = []
        for _ in range(n):
            params = {}
            if rng.random() < 0.6:
                params["repetition_penalty"] = rng.choice([0.5, 1.3, 1e300, 1e-30, rng.uniform(0.1, 3)])
            if rng.random() < 0.5:
                params["presence_penalty"] = rng.uniform(-2, 2)
            if rng.random() < 0.5:
                params["frequency_penalty"] = rng.uniform(-2, 2)
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            output = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            rows.append(row(prompt=prompt, output=output, **params))
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(case)) * rng.choice([1, 1e30])
        want = logits.clone()
        for i, r in enumerate(rows):
            p = r.params
            if p.repetition_penalty not in (0, 1):
                penalty = torch.tensor(p.repetition_penalty, dtype=torch.float32).clamp(
                    max=torch.finfo(torch.float32).max
                )
                seen = torch.zeros(vocab, dtype=torch.bool)
                seen[r.token_ids] = True
                penalized = torch.where(want[i] > 0, want[i] / penalty, want[i] * penalty)
                want[i] = torch.where(
                    seen, penalized.clamp(-sampling.PENALIZED_LIMIT, sampling.PENALIZED_LIMIT), want[i]
                )
            output = r.token_ids[r.num_prompt :]
            if (p.presence_penalty or p.frequency_penalty) and output:
                counts = torch.bincount(torch.tensor(output), minlength=vocab).float()
                freq, presence = torch.tensor([p.frequency_penalty, p.presence_penalty], dtype=torch.float32)
                want[i] = torch.where(counts > 0, want[i] - (freq * counts + presence), want[i])
        assert torch.equal(sampling._apply_penalties(logits, rows), want), case


PROBES = {
    "top-p and top-k": dict(top_p=0.95, top_k=20),
    "top-k": dict(top_k=5),
    "no filter": {},
    "min-p": dict(min_p=0.02),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("probe", PROBES)
def test_a_rows_token_does_not_depend_on_its_batch(device, probe):
    """The probe row, over many draws, at every position of batches of greedy, penalized, filtered, unfiltered
    and logprob rows."""
    probe_logits = logits_for(1, seed=3)[0]
    others = [
        row(),
        row(seed=1, temperature=1.2, min_p=0.05),
        row(output=[1, 1], repetition_penalty=1.2, logprobs=3),
        row(seed=4, temperature=0.7, presence_penalty=1.0, output=[3]),
        row(seed=6, temperature=1.0, top_p=0.5),
        row(seed=7, temperature=0.5, top_k=3),
    ]
    for draw in range(8):
        probe_row = row(seed=99 + draw, output=[5, 6], temperature=0.9, **PROBES[probe])
        alone = sample(probe_logits[None].to(device), [probe_row]).token_ids[0]
        for at in range(len(others) + 1):
            batch_rows = others[:at] + [probe_row] + others[at:]
            logits = torch.cat([logits_for(at, seed=10), probe_logits[None], logits_for(len(others) - at, seed=11)])
            assert sample(logits.to(device), batch_rows).token_ids[at] == alone, (draw, at)


@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_the_filtered_distribution(device):
    """Over many draws: top-k keeps k tokens, top-p the nucleus, min-p the tokens near the top, and the
    frequencies follow the probabilities."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05] + [1e-9] * (VOCAB - 5)))[None].to(device)
    n = 4000

    def draws(**params) -> list[int]:
        return [sample(logits, [row(seed=5, output=[0] * c, **params)]).token_ids[0] for c in range(n)]

    free = draws(temperature=1.0)
    for token, p in enumerate([0.4, 0.3, 0.15, 0.1, 0.05]):
        assert free.count(token) / n == pytest.approx(p, abs=0.03)
    assert set(draws(temperature=1.0, top_k=2)) == {0, 1}
    assert set(draws(temperature=1.0, top_p=0.8)) == {0, 1, 2}  # 0.4 + 0.3 < 0.8: the third one is in
    assert set(draws(temperature=1.0, min_p=0.3)) == {0, 1, 2}  # at least 0.3 x 0.4
    assert set(draws(temperature=0.01)) == {0}
    # Each filter over what the one before kept: top-p over top-k's 0.4 and 0.3 (0.4 / 0.7 > 0.5), and over
    # min-p's 0.4, 0.3 and 0.15 (0.7 / 0.85 > 0.8).
    assert set(draws(temperature=1.0, top_k=2, top_p=0.5)) == {0}
    assert set(draws(temperature=1.0, min_p=0.3, top_p=0.8)) == {0, 1}


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-6])
def test_a_temperature_near_zero_is_greedy_and_leaves_its_batch_alone(temperature):
    """Below GREEDY_BELOW, logits / temperature would overflow to inf and the draw run off the vocabulary:
    such a row is greedy, and the rows beside it sample as they would without it."""
    logits = logits_for(3, seed=2)
    rows = [
        row(seed=1, temperature=1.0, top_k=10),
        row(seed=2, temperature=temperature, top_p=0.9),
        row(seed=3, temperature=0.8),
    ]
    tokens = sample(logits, rows).token_ids
    assert tokens[1] == int(logits[1].argmax())
    assert [tokens[0], tokens[2]] == sample(logits[[0, 2]], [rows[0], rows[2]]).token_ids


@pytest.mark.parametrize("vocab", [50, 151936])
@pytest.mark.parametrize("filters", [{}, dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(top_k=1000)])
@pytest.mark.parametrize("temperature", [1.0, sampling.GREEDY_BELOW])
def test_a_tiny_repetition_penalty_picks_the_repeated_token(vocab, filters, temperature):
    """Dividing a positive logit by 1e-38 overflows float32, and so may the lowest temperature that samples:
    the row's softmax must not turn NaN (its draw would be an id past the vocabulary), and the repeated token,
    now far the most likely, is drawn."""
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * 3
    top = int(logits[0].argmax())
    rows = [
        row(seed=123, prompt=[top], temperature=temperature, repetition_penalty=1e-38, **filters),
        row(seed=1, temperature=1.0),
    ]
    tokens = sample(logits, rows).token_ids
    assert tokens == [top, sample(logits[1:], rows[1:]).token_ids[0]]


def test_a_repetition_penalty_past_float32_keeps_a_zero_logit_a_number():
    """A penalty of 1e300 is a valid double but inf in float32, and 0 x inf is NaN (which greedy's argmax would
    pick): the repeated zero stays zero and the repeated 5 becomes about zero, as dividing by float32's largest
    value makes it, so every row draws what it draws from [0, 0, 1, -1] without a penalty."""
    logits, penalized = torch.tensor([[0.0, 5.0, 1.0, -1.0]]), torch.tensor([[0.0, 0.0, 1.0, -1.0]])
    for seed in range(8):
        for params in (dict(temperature=1.0), dict(temperature=1.0, top_p=0.9), {}):
            token = sample(logits, [row(seed=seed, prompt=[0, 1], repetition_penalty=1e300, **params)]).token_ids
            assert token == sample(penalized, [row(seed=seed, prompt=[0, 1], **params)]).token_ids


@pytest.mark.parametrize("vocab", [50, 5000])
def test_a_row_of_nan_draws_an_id_inside_the_vocabulary(vocab):
    """A model that overflowed gives NaN logits: the step must not index past the vocabulary (on CUDA, a
    device-side assert that would end every later step)."""
    logits = torch.full((1, vocab), float("nan"))
    for params in ({}, dict(top_k=5), dict(top_p=0.9)):
        assert 0 <= sample(logits, [row(temperature=1.0, **params)]).token_ids[0] < vocab


def test_a_top_p_row_on_the_edge_of_its_nucleus_does_not_depend_on_its_batch():
    """torch splits one row's long sum over threads but sums each of many rows in one thread, so the same row's
    total can differ in its last bit with the batch. A top-p cut placed exactly between the two totals must
    still fall the same way."""
    vocab, k = 151936, 3
    for case in range(40):
        logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(case)) * 6
        probs = torch.softmax(logits, dim=-1)
        alone, batched = probs[:1].sum(-1).item(), probs.sum(-1)[0].item()
        if alone != batched:
            break
    else:
        pytest.skip("one thread sums the same bits alone and in a batch: no edge to test on this machine")
    values = probs[0].topk(sampling.CANDIDATES).values
    edge = (values.cumsum(-1) - values)[k].item()  # the mass of the k most likely tokens
    for total in (alone, batched):  # a top_p whose cut lands on the edge under one total and not the other
        top_p = float(torch.tensor(edge / total, dtype=torch.float32))
        sides = {edge >= (torch.tensor(top_p) * torch.tensor(t)).item() for t in (alone, batched)}
        if len(sides) == 2:
            break
    else:
        pytest.skip("the totals differ by less than a top_p can tell apart")
    other = row(seed=7, temperature=1.0, top_p=0.5)
    for seed in range(60):
        probe = row(seed=seed, temperature=1.0, top_p=top_p)
        assert sample(logits[:1], [probe]).token_ids[0] == sample(logits, [probe, other]).token_ids[0], seed


@pytest.mark.parametrize("device", DEVICES)
def test_rows_that_look_past_the_candidates_sort_the_vocabulary(device):
    """Rows whose filters keep more than the top candidates (a wide nucleus, a large top-k) take the full
    sort, beside rows that do not: every draw is a token its filters keep, and the same as the row alone."""
    vocab = 4 * sampling.CANDIDATES
    flat = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 0.1
    peaked = flat.clone()
    peaked[:5] += 12
    cases = [
        (flat, dict(top_p=0.5)),
        (peaked, dict(top_p=0.9)),
        (flat, dict(top_k=sampling.CANDIDATES + 44)),
        (flat, dict(top_k=7, top_p=0.99)),
    ]
    for counter in range(30):
        rows = [row(seed=i, output=[0] * counter, temperature=1.0, **params) for i, (_, params) in enumerate(cases)]
        logits = torch.stack([lg for lg, _ in cases]).to(device)
        tokens = sample(logits, rows).token_ids
        for i, (lg, params) in enumerate(cases):
            assert tokens[i] == sample(lg[None].to(device), [rows[i]]).token_ids[0]
            probs, order = torch.softmax(lg.double(), dim=-1).sort(descending=True)
            rank, top_k = order.tolist().index(tokens[i]), params.get("top_k", vocab)
            assert rank < top_k
            assert probs[:rank].sum() < params.get("top_p", 1.0) * probs[:top_k].sum()


def test_a_draw_at_the_top_of_the_range_lands_on_a_possible_token(monkeypatch):
    """The largest uniform times the total must stay below the total: the draw must not fall on the
    zero-probability tail."""

    def largest(seeds, counters):  # every row's every draw, as `uniforms` makes them
        return np.full(np.broadcast(np.asarray(seeds), np.asarray(counters)).shape, 1 - 2.0**-24, dtype=np.float32)

    monkeypatch.setattr(sampling, "uniforms", largest)
    logits = torch.full((1, VOCAB), -1e4)
    logits[0, :3] = torch.tensor([1.0, 0.5, 0.25])
    assert sample(logits, [row(temperature=1.0, top_k=3)]).token_ids == [2]
    assert sample(logits, [row(temperature=1.0)]).token_ids[0] < 3


@pytest.mark.parametrize("device", DEVICES)
def test_logits_lent_to_the_sampler_draw_the_same_tokens_and_logprobs(device):
    """A model runner lends the sampler its step's logits (`scratch`): the temperature may divide them in place.
    The draws and log-probabilities are those of logits not lent, and where a row reads log-probabilities
    (raw or processed) the logits are left as they were."""
    kinds = [
        [dict(temperature=0.7), dict(temperature=1.3, top_p=0.9)],  # every row samples: divided in place
        [dict(temperature=0.7, logprobs=2), dict(temperature=1.1)],  # a row reads log-probabilities
        [dict(temperature=0.8, logprobs=1, logprobs_mode="processed"), dict(temperature=0.5, top_k=5)],
        [dict(), dict(temperature=0.9, logprobs=1)],  # a greedy row: the others' logits are a copy
    ]
    for case, params in enumerate(kinds):
        logits = logits_for(len(params), case).to(device)
        kept = sampling.launch_sample(logits.clone(), [row(i, **p) for i, p in enumerate(params)]).result()
        lent = logits.clone()
        got = sampling.launch_sample(lent, [row(i, **p) for i, p in enumerate(params)], scratch=True).result()
        assert (got.token_ids, got.logprobs) == (kept.token_ids, kept.logprobs), case
        reads = any(p.get("logprobs") for p in params)
        assert torch.equal(lent, logits) == (reads or any(not p for p in params)), case


def test_the_largest_draw_finds_a_token_of_its_row_whatever_its_total():
    """`_search` takes draw x total as its target unguarded: the largest draw (the largest float32 below 1) must
    leave it below the total, so that the search finds the row's last token of non-zero probability and not the
    zeros after it, for every float32 total above the subnormals (every mantissa, at three exponents)."""
    totals = (torch.arange(2**23, dtype=torch.int32) | (127 << 23)).view(torch.float32)  # each float32 in [1, 2)
    largest = torch.full((len(totals), 1), 1 - 2.0**-24)
    for scale in (2.0**-125, 2.0**-20, 2.0**100):
        probs = torch.stack([totals * scale, torch.zeros_like(totals)], dim=1)  # one token, then a zero
        assert not sampling._search(probs, largest)[0].any(), scale


@pytest.mark.parametrize("device", DEVICES)
def test_a_draw_over_a_large_vocabulary_finds_its_block_then_its_token(device):
    """Past DRAW_BLOCK tokens a draw searches block sums, then one block: the token where the whole cumulative
    distribution passes the draw (float64 here, so that no rounding tells the two apart), never one of zero
    probability, a zero-mass block and the padding of the last block included."""
    vocab = 3 * sampling.DRAW_BLOCK + 100
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(5, vocab, generator=g, dtype=torch.float64)
    probs[:, sampling.DRAW_BLOCK : 2 * sampling.DRAW_BLOCK] = 0  # a block without mass
    probs[1, 50:] = 0  # all of one row's mass in its first block
    probs[2, : 3 * sampling.DRAW_BLOCK] = 0  # and another's in the padded last one
    probs[3, ::2] = 0
    probs = probs.to(device)
    for u in torch.rand(40, generator=g, dtype=torch.float64).tolist() + [0.0, 1 - 2.0**-24]:
        draws = torch.full((5, 1), u, dtype=torch.float64, device=device)
        got = sampling._draw(probs, draws)
        assert got.tolist() == sampling._search(probs, draws)[0].tolist()  # one search over the whole vocabulary
        assert bool((probs.gather(1, got.unsqueeze(1)) > 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_of_the_unpenalized_distribution_per_row(device):
    logits = logits_for(3, seed=2).to(device)
    rows = [row(logprobs=2), row(), row(seed=3, temperature=1.0, logprobs=5, repetition_penalty=1.5, output=[4])]
    result = sample(logits, rows)
    lp = torch.log_softmax(logits.cpu().double(), dim=-1)
    assert result.logprobs[1] is None
    for i, n in ((0, 2), (2, 5)):
        chosen, top = result.logprobs[i]
        assert chosen == pytest.approx(lp[i, result.token_ids[i]].item(), abs=1e-5)
        assert [t for t, _ in top] == lp[i].topk(n).indices.tolist()
        assert [v for _, v in top] == pytest.approx(lp[i].topk(n).values.tolist(), abs=1e-5)
    assert result.token_ids[0] == int(logits[0].argmax())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_same_tokens_on_cuda_as_on_the_cpu():
    logits = logits_for(8, seed=6)
    rows = [
        row(
            seed=s,
            output=[s % 7],
            temperature=0.8,
            top_k=10 * (s % 3),
            top_p=0.9 if s % 2 else 0.0,
            repetition_penalty=1.1 if s % 4 == 0 else 0.0,
        )
        for s in range(8)
    ]
    assert sample(logits.cuda(), rows).token_ids == sample(logits, rows).token_ids


def test_a_step_where_no_row_samples():
    """Every sequence of a step mid-prompt (chunked prefills): no logits, nothing drawn."""
    result = sample(torch.empty(0, VOCAB), [])
    assert result.token_ids == [] and result.logprobs == []
