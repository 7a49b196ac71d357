"""Log-probabilities a trainer can trust (SamplingParams.logprobs_mode), on the embedded SmolLM2 in float32:

* raw: the sampled tokens' log-probabilities equal transformers' log-softmax of the same sequence within 1e-4,
  greedy and seeded, in a batch that mixes raw rows, processed rows and rows without logprobs;
* processed: equal a float64 reference of the sampler's processing written here from its definition (logit
  bias, penalties, temperature, min-p, top-k, top-p, renormalized; -inf where removed), and a constrained
  row's are renormalized over what its mask allows;
* the mode changes no token, goes through the gRPC server (GenerateResponse.logprobs_mode) and the Python
  client, and a bad mode is refused.
"""

from __future__ import annotations

import dataclasses
import math

import grpc
import pytest
import torch

from lmgate.client import Client
from lmgate.client.wire import sampling_params as client_sampling_params
from lmgate.engine.errors import InvalidRequest
from lmgate.engine.gateway.request import TokenLogprob
from lmgate.engine.sampling.constraints import Constraint
from lmgate.engine.sampling.sampler import SampleRow, SamplingParams, sample
from lmgate.v1 import lmgate_pb2 as pb

GUARD = 120  # seconds: a guard against a hang, never a timing
RAW_TOL = 1e-4  # float32 engine against float32 transformers
PROCESSED_TOL = 2e-4  # float32 sampler against a float64 reference (a temperature below 1 scales the error up)
PROMPTS = ("The capital of France is", "Once upon a time, there was a little")
NEW = 6
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=40, seed=7, presence_penalty=0.5, frequency_penalty=0.3)
# The batch: each name's prompt (by index) and parameters, all submitted at once.
BATCH = {
    "raw_greedy": (0, SamplingParams(logprobs=3)),
    "raw_sampled": (1, SamplingParams(logprobs=2, **SAMPLED)),
    "processed_sampled": (1, SamplingParams(logprobs=4, logprobs_mode="processed", **SAMPLED)),
    "none_sampled": (1, SamplingParams(**SAMPLED)),
    "processed_greedy_top_k": (
        0,
        SamplingParams(logprobs=5, logprobs_mode="processed", top_k=3, repetition_penalty=1.3, logit_bias=((11, 2.0),)),
    ),
    "processed_min_p": (0, SamplingParams(logprobs=3, logprobs_mode="processed", temperature=1.2, min_p=0.05, seed=5)),
    "processed_top_p": (1, SamplingParams(logprobs=2, logprobs_mode="processed", temperature=0.7, top_p=0.8, seed=11)),
    "none_greedy": (0, SamplingParams()),
}


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits of every position of `ids`, in float64."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].double()


def collect(stream) -> tuple[list[int], list[TokenLogprob]]:
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    for out in stream:
        tokens += out.token_ids
        logprobs += out.logprobs
    return tokens, logprobs


@pytest.fixture(scope="module")
def engine(server):
    """The conftest's server's engine (float32, on the CPU), used in-process as well as through gRPC."""
    return server.engine


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    return [engine.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def mixed(engine, prompts) -> dict[str, tuple[list[int], list[TokenLogprob]]]:
    """BATCH's requests, submitted together so that they share their steps: each one's tokens and logprobs."""
    streams = {
        name: engine.submit(prompts[p], dataclasses.replace(params, max_new_tokens=NEW, ignore_eos=True))
        for name, (p, params) in BATCH.items()
    }
    return {name: collect(stream) for name, stream in streams.items()}


def processed_reference(logits: torch.Tensor, context: list[int], num_prompt: int, p: SamplingParams) -> torch.Tensor:
    """The documented processing in float64, over one position's logits: logit_bias; repetition penalty over the
    context (a positive logit divided by it, another multiplied); presence and frequency penalties over the
    output so far; temperature (1 when greedy); min-p against the most likely token; top-k; top-p of what top-k
    kept (a token stays while the mass before it is below p); log-softmax of what is left, -inf elsewhere."""
    x = logits.clone()
    vocab = x.shape[-1]
    for token, bias in p.logit_bias:
        x[token] += bias
    if p.repetition_penalty not in (0, 1):
        ids = torch.tensor(sorted(set(context)))
        seen = x[ids]
        x[ids] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
    counts = torch.bincount(torch.tensor(context[num_prompt:], dtype=torch.long), minlength=vocab).double()
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).double()
    x /= 1.0 if p.temperature == 0 else p.temperature
    probs = torch.softmax(x, dim=-1)
    removed = probs < p.min_p * probs.max()
    values, order = probs.masked_fill(removed, 0.0).sort(descending=True)
    if 0 < p.top_k < vocab:
        removed[order[p.top_k :]] = True
        values[p.top_k :] = 0.0
    if 0 < p.top_p < 1:
        before = values.cumsum(dim=-1) - values
        removed[order[before >= p.top_p * values.sum()]] = True
    return x.masked_fill(removed, float("-inf")).log_softmax(dim=-1)


# ------------------------------------------------------------------------------------------- raw
@pytest.mark.parametrize("name", ["raw_greedy", "raw_sampled"])
def test_raw_logprobs_equal_transformers_log_softmax_in_a_mixed_batch(name, mixed, prompts, hf_model):
    prompt = prompts[BATCH[name][0]]
    tokens, logprobs = mixed[name]
    assert len(tokens) == len(logprobs) == NEW
    lp = hf_logits(hf_model, prompt + tokens).log_softmax(dim=-1)[len(prompt) - 1 : -1]
    if name == "raw_greedy":
        assert tokens == lp.argmax(dim=-1).tolist()
    for i, (token, scored) in enumerate(zip(tokens, logprobs)):
        assert scored.token_id == token
        assert scored.logprob == pytest.approx(lp[i, token].item(), abs=RAW_TOL)
        ids, values = [t for t, _ in scored.top], [v for _, v in scored.top]
        assert len(ids) == BATCH[name][1].logprobs
        assert values == pytest.approx(lp[i, ids].tolist(), abs=RAW_TOL)
        assert values == pytest.approx(lp[i].topk(len(ids)).values.tolist(), abs=RAW_TOL)


def test_the_mode_changes_no_token(mixed):
    assert mixed["raw_sampled"][0] == mixed["processed_sampled"][0] == mixed["none_sampled"][0]
    assert mixed["none_sampled"][1] == [] and mixed["none_greedy"][1] == []


# ------------------------------------------------------------------------------------------- processed
@pytest.mark.parametrize("name", ["processed_sampled", "processed_greedy_top_k", "processed_min_p", "processed_top_p"])
def test_processed_logprobs_equal_a_float64_reference_of_the_sampling(name, mixed, prompts, hf_model):
    prompt, params = prompts[BATCH[name][0]], BATCH[name][1]
    tokens, logprobs = mixed[name]
    assert len(tokens) == len(logprobs) == NEW
    logits = hf_logits(hf_model, prompt + tokens)[len(prompt) - 1 : -1]
    for i, (token, scored) in enumerate(zip(tokens, logprobs)):
        ref = processed_reference(logits[i], prompt + tokens[:i], len(prompt), params)
        assert math.isfinite(scored.logprob)  # a drawn token was never removed
        assert scored.logprob == pytest.approx(ref[token].item(), abs=PROCESSED_TOL)
        kept = int(torch.isfinite(ref).sum())
        finite = [(t, v) for t, v in scored.top if math.isfinite(v)]
        assert len(scored.top) == params.logprobs and len(finite) == min(params.logprobs, kept)
        assert [v for _, v in finite] == pytest.approx([ref[t].item() for t, _ in finite], abs=PROCESSED_TOL)
        assert [v for _, v in finite] == pytest.approx(ref.topk(len(finite)).values.tolist(), abs=PROCESSED_TOL)
        assert all(v == float("-inf") and ref[t] == float("-inf") for t, v in scored.top[len(finite) :])
    if name == "processed_greedy_top_k":  # top_k 3 of 5 alternatives: two removed, shown as -inf
        assert all(len([v for _, v in s.top if v == float("-inf")]) == 2 for s in logprobs)


def test_processed_logprobs_of_a_constrained_row_are_renormalized_over_its_mask(engine, prompts, hf_model):
    """A choice between "yes" and "no": at each position the tokens the mask allows hold all the mass (there are
    fewer than 20, so all of them are among the alternatives), each in proportion to the model's probability."""
    prompt = prompts[0]
    choice = Constraint.choice(["yes", "no"])
    params = SamplingParams(max_new_tokens=NEW, logprobs=20, logprobs_mode="processed", constraint=choice)
    raw = SamplingParams(max_new_tokens=NEW, logprobs=20, constraint=choice)
    (tokens, logprobs), (raw_tokens, raw_logprobs) = [collect(engine.submit(prompt, p)) for p in (params, raw)]
    assert tokens == raw_tokens and engine.tokenizer.decode(tokens) in ("yes", "no")
    lp = hf_logits(hf_model, prompt + tokens).log_softmax(dim=-1)[len(prompt) - 1 : -1]
    first = [t for t, v in logprobs[0].top if math.isfinite(v)]
    assert first and all(any(c.startswith(engine.tokenizer.decode([t])) for c in ("yes", "no")) for t in first)
    for i, (scored, unmasked) in enumerate(zip(logprobs, raw_logprobs)):
        allowed = [t for t, v in scored.top if math.isfinite(v)]
        assert sum(math.exp(v) for _, v in scored.top) == pytest.approx(1.0, abs=1e-5)
        expected = lp[i, allowed] - lp[i, allowed].logsumexp(dim=-1)
        assert [v for t, v in scored.top if t in allowed] == pytest.approx(expected.tolist(), abs=RAW_TOL)
        assert scored.logprob >= unmasked.logprob - 1e-6  # renormalized over a part of the vocabulary


@pytest.mark.parametrize("device", DEVICES)
def test_a_steps_processed_logprobs_on_tensors_equal_the_reference(device):
    """The sampler alone, on the device where a GPU is present: raw, processed and no-logprob rows in one step."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4)) * 3
    params = [
        SamplingParams(logprobs=5, logprobs_mode="processed", temperature=0.7, top_p=0.8),
        SamplingParams(logprobs=2),
        SamplingParams(logprobs=6, logprobs_mode="processed", top_k=4, min_p=0.1),
        SamplingParams(temperature=1.0),
        SamplingParams(logprobs=3, logprobs_mode="processed", temperature=1.5, logit_bias=((7, 5.0),)),
    ]
    result = sample(logits.to(device), [SampleRow(p, seed, [1, 2, 3], 3) for seed, p in enumerate(params)])
    assert result.logprobs[3] is None
    for i, p in enumerate(params):
        if not p.logprobs:
            continue
        if p.logprobs_mode == "raw":
            ref = logits[i].double().log_softmax(dim=-1)
        else:
            ref = processed_reference(logits[i].double(), [1, 2, 3], 3, p)
        chosen, top = result.logprobs[i]
        assert chosen == pytest.approx(ref[result.token_ids[i]].item(), abs=1e-5)
        assert [v for _, v in top] == pytest.approx(ref.topk(p.logprobs).values.tolist(), abs=1e-5)
        assert all(ref[t] == v or abs(ref[t] - v) < 1e-5 for t, v in top)


# ------------------------------------------------------------------------------------------- the wire
def test_grpc_responses_say_which_logprobs_they_carry(server, prompts, hf_model):
    prompt = prompts[0]
    stub = server.stub()

    def generate(**sampling) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(tokens=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(**sampling))
        return list(stub.Generate(request, timeout=GUARD))

    raw = generate(max_new_tokens=NEW, ignore_eos=True, logprobs=2)
    assert all(m.logprobs_mode == pb.LOGPROBS_MODE_RAW for m in raw if m.logprobs)
    tokens = [t for m in raw for t in m.token_ids]
    lp = hf_logits(hf_model, prompt + tokens).log_softmax(dim=-1)[len(prompt) - 1 : -1]
    got = [scored.logprob for m in raw for scored in m.logprobs]
    assert got == pytest.approx([lp[i, t].item() for i, t in enumerate(tokens)], abs=RAW_TOL)

    processed = generate(max_new_tokens=NEW, ignore_eos=True, logprobs=2, top_k=1, logprobs_mode=2)
    assert [t for m in processed for t in m.token_ids] == tokens  # top_k 1 of a greedy request: the same tokens
    assert all(m.logprobs_mode == pb.LOGPROBS_MODE_PROCESSED for m in processed if m.logprobs)
    assert all(lp.logprob == 0.0 and lp.top[1].logprob == float("-inf") for m in processed for lp in m.logprobs)
    assert all(m.logprobs_mode == pb.LOGPROBS_MODE_UNSPECIFIED for m in generate(max_new_tokens=2))

    with pytest.raises(grpc.RpcError) as err:  # an enum value this server does not know (proto3 enums are open)
        generate(max_new_tokens=2, logprobs=1, logprobs_mode=7)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_python_client_asks_for_a_mode_and_says_which_came_back(server, engine, prompts):
    prompt = prompts[1]
    sampling = dict(max_new_tokens=NEW, ignore_eos=True, logprobs=2, temperature=0.8, top_p=0.9, seed=3)
    expected = collect(engine.submit(prompt, SamplingParams(logprobs_mode="processed", **sampling)))
    with Client(server.address) as client:
        deltas = list(client.generate(token_ids=prompt, logprobs_mode="processed", **sampling))
        raw = list(client.generate(token_ids=prompt, **sampling))
    assert {d.logprobs_mode for d in deltas if d.logprobs} == {"processed"}
    assert {d.logprobs_mode for d in raw if d.logprobs} == {"raw"}
    assert [t for d in deltas for t in d.token_ids] == expected[0] == [t for d in raw for t in d.token_ids]
    got = [lp["logprob"] for d in deltas for lp in d.logprobs]
    assert got == pytest.approx([lp.logprob for lp in expected[1]], abs=1e-6)
    assert [lp["top"][1]["logprob"] for d in deltas for lp in d.logprobs] == pytest.approx(
        [lp.top[1][1] for lp in expected[1]], abs=1e-6
    )


def test_a_bad_logprobs_mode_is_refused():
    with pytest.raises(InvalidRequest, match="logprobs_mode"):
        SamplingParams(logprobs=1, logprobs_mode="softmax")
    with pytest.raises(ValueError, match="logprobs_mode"):
        client_sampling_params(logprobs=1, logprobs_mode="Processed")
    assert client_sampling_params(logprobs_mode="processed").logprobs_mode == pb.LOGPROBS_MODE_PROCESSED
