"""Protobuf messages to engine values and back; validation of what only the wire can get wrong."""

from __future__ import annotations

from typing import Callable

from lmgate.engine.errors import InvalidRequest
from lmgate.engine.gateway.request import FinishReason, RequestOutput
from lmgate.engine.sampling.sampler import SamplingParams
from lmgate.v1 import lmgate_pb2 as pb

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


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
        skip_special_tokens=not s.include_special_tokens,
    )


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


def merge(outputs: list[RequestOutput], token_text: Callable[[int], str]) -> pb.GenerateResponse:
    """Deltas that queued up while the client was slow, sent as one message; `token_text` names each
    log-probability's token (`Tokenizer.token_text`)."""
    last = outputs[-1]
    msg = pb.GenerateResponse(
        request_id=last.request_id,
        session_id=last.session_id,
        token_ids=[t for o in outputs for t in o.token_ids],
        text="".join(o.text for o in outputs),
        finish_reason=_FINISH[last.finish_reason],
    )
    for o in outputs:
        for lp in o.logprobs:
            msg.logprobs.add(
                token_id=lp.token_id,
                logprob=lp.logprob,
                token=token_text(lp.token_id),
                top=[pb.TopLogprob(token_id=t, logprob=v, token=token_text(t)) for t, v in lp.top],
            )
    if last.usage is not None:
        msg.usage.CopyFrom(
            pb.Usage(**{f: getattr(last.usage, f) for f in ("prompt_tokens", "completion_tokens", "cached_tokens")})
        )
    return msg
