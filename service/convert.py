"""Protobuf messages to engine values and back; validation of what only the wire can get wrong."""

from __future__ import annotations

import itertools
from typing import Callable

from lmgate.engine.errors import InvalidRequest
from lmgate.engine.gateway.request import FinishReason, RequestOutput, TokenLogprob
from lmgate.engine.sampling.constraints import Constraint, ConstraintKind
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.v1 import lmgate_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ABORTED: pb.FINISH_REASON_ABORTED,
}
# LogprobsMode to SamplingParams.logprobs_mode (unset: raw), and back on the messages that carry logprobs.
_LOGPROBS_MODE = {
    pb.LOGPROBS_MODE_UNSPECIFIED: "raw",
    pb.LOGPROBS_MODE_RAW: "raw",
    pb.LOGPROBS_MODE_PROCESSED: "processed",
}
_LOGPROBS_MODE_OUT = {"raw": pb.LOGPROBS_MODE_RAW, "processed": pb.LOGPROBS_MODE_PROCESSED}


def sampling_params(s: pb.SamplingParams) -> SamplingParams:
    """Raises InvalidRequest for values out of range (NaN, negative, ...)."""
    return SamplingParams(
        max_new_tokens=s.max_new_tokens,
        min_new_tokens=s.min_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        logprobs_mode=logprobs_mode(s.logprobs_mode),
        skip_special_tokens=not s.include_special_tokens,
        n=max(s.n, 1),
        logit_bias=tuple(sorted(s.logit_bias.items())),
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        constraint=constraint(s),
        keep_kv_on_update=s.keep_kv_on_update,
    )


def logprobs_mode(mode: int) -> str:
    """The engine's name of a LogprobsMode; InvalidRequest for a number the enum does not name (proto3 enums
    are open: a client built from another version of the proto may send one)."""
    if mode not in _LOGPROBS_MODE:
        raise InvalidRequest(f"logprobs_mode must be a LogprobsMode (0, 1 or 2), got {mode}")
    return _LOGPROBS_MODE[mode]


def constraint(s: pb.SamplingParams | vllm.SamplingParams) -> Constraint | None:
    """The structured-output constraint of either protocol's SamplingParams (their `constraint` oneofs name the
    same kinds), or None. A json_object set to false asks for nothing."""
    kind = s.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not s.json_object):
        return None
    if kind == "choice":
        return Constraint.choice(s.choice.choices)
    return Constraint(ConstraintKind(kind), "" if kind == "json_object" else getattr(s, kind))


def prompt(request: pb.GenerateRequest) -> str | list[int] | list[dict[str, str]]:
    """The turn's input: text or chat messages for the engine to encode or render (a session renders its whole
    conversation; a text gets the model's special tokens, a BOS where it uses one, when stateless or the
    session's first turn), or token ids as they are."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return request.prompt
    if kind == "tokens":
        return list(request.tokens.ids)
    if kind == "messages":
        if not request.messages.messages:
            raise InvalidRequest("messages is empty")
        return [{"role": m.role, "content": m.content} for m in request.messages.messages]
    raise InvalidRequest("no input: set one of prompt, tokens or messages")


# A message's most bytes: under a client's default 4 MiB limit on what it receives, with room to spare.
MAX_MESSAGE_BYTES = 3 << 20


def responses(
    outputs: list[RequestOutput], token_text: Callable[[int], str], logprobs_mode: str = "raw"
) -> list[pb.GenerateResponse]:
    """Deltas that queued up while the client was slow, sent as one message per run of one sample's; a long
    prompt's log-probabilities go ahead in messages of their own, each under MAX_MESSAGE_BYTES. Tokens of
    different weight versions never share a message. `logprobs_mode`: the request's
    (`SamplingParams.logprobs_mode`), named on each message that carries logprobs."""
    runs = [list(run) for _, run in itertools.groupby(outputs, key=lambda o: o.index)]
    return [
        part
        for run in runs
        for same in _by_weight_version(run)
        for part in _split(merge(same, token_text, logprobs_mode))
    ]


def _by_weight_version(run: list[RequestOutput]) -> list[list[RequestOutput]]:
    """A sample's run cut where the weights that computed its tokens change (an output without tokens stays
    with the one before it)."""
    parts: list[list[RequestOutput]] = [[]]
    version = None
    for out in run:
        if out.token_ids and version is not None and out.weight_version != version:
            parts.append([])
        if out.token_ids:
            version = out.weight_version
        parts[-1].append(out)
    return parts


def _split(msg: pb.GenerateResponse) -> list[pb.GenerateResponse]:
    size = msg.ByteSize()
    if size <= MAX_MESSAGE_BYTES or not msg.prompt_logprobs:
        return [msg]
    scored = list(msg.prompt_logprobs)
    per = max(1, len(scored) * MAX_MESSAGE_BYTES // size)
    del msg.prompt_logprobs[:]
    heads = [
        pb.GenerateResponse(
            request_id=msg.request_id, session_id=msg.session_id, index=msg.index, prompt_logprobs=scored[at : at + per]
        )
        for at in range(0, len(scored), per)
    ]
    return [*heads, msg]


def merge(
    outputs: list[RequestOutput], token_text: Callable[[int], str], logprobs_mode: str = "raw"
) -> pb.GenerateResponse:
    """Deltas of one sample, sent as one message; `token_text` names each log-probability's token
    (`Tokenizer.token_text`), `logprobs_mode` (the request's) what the logprobs are of."""
    last = outputs[-1]
    msg = pb.GenerateResponse(
        request_id=last.request_id,
        session_id=last.session_id,
        token_ids=[t for o in outputs for t in o.token_ids],
        text="".join(o.text for o in outputs),
        finish_reason=_FINISH[last.finish_reason],
        index=last.index,
        weight_version=next((o.weight_version for o in outputs if o.token_ids), ""),
    )
    for o in outputs:
        add_logprobs(msg.logprobs, o.logprobs, token_text)
        add_logprobs(msg.prompt_logprobs, o.prompt_logprobs or [], token_text)
    if msg.logprobs:
        msg.logprobs_mode = _LOGPROBS_MODE_OUT[logprobs_mode]
    if last.usage is not None:
        msg.usage.CopyFrom(
            pb.Usage(**{f: getattr(last.usage, f) for f in ("prompt_tokens", "completion_tokens", "cached_tokens")})
        )
    return msg


def add_logprobs(into, logprobs: list[TokenLogprob], token_text: Callable[[int], str]) -> None:
    """Append each token's log-probability and alternatives, with their texts, to a repeated TokenLogprob."""
    for lp in logprobs:
        into.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            token=token_text(lp.token_id),
            top=[pb.TopLogprob(token_id=t, logprob=v, token=token_text(t)) for t, v in lp.top],
        )


# Admin.Pause's modes, the engine's names (`Engine.pause`) by proto value; unset is ABORT, as vLLM's default.
_PAUSE_MODES = {
    pb.PAUSE_MODE_UNSPECIFIED: "abort",
    pb.PAUSE_MODE_ABORT: "abort",
    pb.PAUSE_MODE_WAIT: "wait",
    pb.PAUSE_MODE_KEEP: "keep",
}


def pause_mode(mode: int) -> str:
    """The engine's name of a PauseRequest.mode; an unknown value is refused."""
    if mode not in _PAUSE_MODES:
        raise InvalidRequest(f"unknown pause mode {mode}")
    return _PAUSE_MODES[mode]


def pause_mode_value(mode: str | None) -> int:
    """InfoResponse.pause_mode of the engine's (None: not paused)."""
    if mode is None:
        return pb.PAUSE_MODE_UNSPECIFIED
    return {"abort": pb.PAUSE_MODE_ABORT, "wait": pb.PAUSE_MODE_WAIT, "keep": pb.PAUSE_MODE_KEEP}[mode]
