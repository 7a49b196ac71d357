"""Python values to lmgate messages and back: pure functions shared by `Client` and `AsyncClient`."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from google.protobuf.descriptor import FieldDescriptor

from lmgate.v1 import lmgate_pb2 as pb

# The sampling keyword arguments: exactly SamplingParams' fields, so a new proto field needs no client change.
SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)

# What each integer type of a proto field holds: protobuf refuses a value beyond it with a bare "Value out of
# range" that names neither the field nor its range.
_INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}

_USAGE_FIELDS = tuple(f.name for f in pb.Usage.DESCRIPTOR.fields)
_FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ABORTED: "aborted",
}
# `logprobs_mode="raw" | "processed"`: which distribution a token's log-probability is of (the proto's LogprobsMode).
LOGPROBS_MODES = {"raw": pb.LOGPROBS_MODE_RAW, "processed": pb.LOGPROBS_MODE_PROCESSED}
_LOGPROBS_MODE_NAMES = {number: name for name, number in LOGPROBS_MODES.items()}


@dataclass(frozen=True, slots=True)
class Delta:
    """One message of a Generate stream, in plain Python types.

    `logprobs` has one entry per token of `token_ids` when sampling asked for them:
    `{"token_id": int, "token": str, "logprob": float, "top": [{"token_id", "token", "logprob"}, ...]}`, each
    token with its text as OpenAI's logprobs show it (U+FFFD where it holds part of a character);
    `logprobs_mode` says which they are: "raw" (the model's distribution, before logit_bias, penalties,
    temperature and the filters) or "processed" (the one the token was drawn from; -inf where filtered out),
    as asked by the `logprobs_mode` sampling keyword; None on a delta without logprobs (or from a server that
    predates the field).
    `finish_reason` ("stop", "length", "cancelled", "aborted": a pause ended it) and `usage` (prompt_tokens,
    completion_tokens, cached_tokens) are set on the last message of the stream only; with `n` samples, on each
    sample's last (`index` says whose). `prompt_logprobs` (when asked for) come with sample 0's first message,
    in the form of `logprobs`, one per prompt token from the second. `weight_version` names the weights that
    computed `token_ids` (the server's UpdateWeights version; "" on a delta without tokens).
    """

    request_id: str
    session_id: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[str, Any]]
    finish_reason: str | None
    usage: dict[str, int] | None
    index: int = 0
    prompt_logprobs: list[dict[str, Any]] = field(default_factory=list)
    logprobs_mode: str | None = None
    weight_version: str = ""


def sampling_range(name: str) -> tuple[int, int] | None:
    """The values SamplingParams' field `name` holds if it is an integer field (None otherwise): the client
    checks them, and the CLI's flags take them."""
    return _INT_RANGES.get(pb.SamplingParams.DESCRIPTOR.fields_by_name[name].cpp_type)


def sampling_params(**sampling: Any) -> pb.SamplingParams:
    """SamplingParams from keyword arguments named as its fields; None leaves a field unset (its default).

    A single string for a repeated field (`stop="\\n"`) counts as a list of one; `logprobs_mode` is "raw" or
    "processed" (or a LogprobsMode number). Unknown names raise TypeError, as an unknown keyword argument of a
    Python function would; an integer beyond its field's range (`seed=-1`) raises ValueError naming the field
    and its range, as does a logprobs_mode string other than those two.
    """
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown sampling parameter(s): {', '.join(unknown)}; expected some of {sorted(SAMPLING_FIELDS)}"
        )
    fields = pb.SamplingParams.DESCRIPTOR.fields_by_name
    values = {}
    for name, value in sampling.items():
        if value is None:
            continue
        if isinstance(value, str) and fields[name].is_repeated:
            value = [value]
        if name == "choice" and not isinstance(value, pb.Choices):  # a list of strings will do
            value = pb.Choices(choices=list(value))
        if name == "logprobs_mode" and isinstance(value, str):
            if value not in LOGPROBS_MODES:
                raise ValueError(f"logprobs_mode must be one of {', '.join(map(repr, LOGPROBS_MODES))}, got {value!r}")
            value = LOGPROBS_MODES[value]
        _check_range(name, value)
        values[name] = value
    return pb.SamplingParams(**values)


def _check_range(name: str, value: Any) -> None:
    """ValueError for an integer (or an integer of a list) beyond field `name`'s range; other types are left
    to protobuf, whose TypeError names them."""
    limits = sampling_range(name)
    if limits is None:
        return
    low, high = limits
    for v in value if isinstance(value, Sequence) else (value,):
        if isinstance(v, int) and not low <= v <= high:
            raise ValueError(f"{name} must be in {low}..{high}, got {v}")


def generate_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Mapping[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    session_id: int = 0,
    request_id: str = "",
    session_epoch: int | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """The GenerateRequest for exactly one input: a text prompt, chat messages ({"role", "content"} dicts,
    rendered by the server's chat template) or token ids. Raises TypeError for none or several inputs."""
    given = [
        name
        for name, value in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
        if value is not None
    ]
    if len(given) != 1:
        raise TypeError(f"generate() takes exactly one of prompt, messages, token_ids; got {given or 'none'}")
    request = pb.GenerateRequest(
        session_id=session_id, request_id=request_id, session_epoch=session_epoch, sampling=sampling_params(**sampling)
    )
    if prompt is not None:
        request.prompt = prompt
    elif messages is not None:
        request.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
        request.messages.SetInParent()  # an empty list is still the chosen input (the server refuses it)
    else:
        request.tokens.ids.extend(token_ids)
        request.tokens.SetInParent()
    return request


def to_delta(response: pb.GenerateResponse) -> Delta:
    return Delta(
        request_id=response.request_id,
        session_id=response.session_id,
        token_ids=list(response.token_ids),
        text=response.text,
        logprobs=_logprobs(response.logprobs),
        finish_reason=_FINISH_REASONS.get(response.finish_reason),
        usage=({f: getattr(response.usage, f) for f in _USAGE_FIELDS} if response.HasField("usage") else None),
        index=response.index,
        prompt_logprobs=_logprobs(response.prompt_logprobs),
        logprobs_mode=_LOGPROBS_MODE_NAMES.get(response.logprobs_mode),
        weight_version=response.weight_version,
    )


def _logprobs(logprobs: Sequence[pb.TokenLogprob]) -> list[dict[str, Any]]:
    return [{**_logprob(lp), "top": [_logprob(t) for t in lp.top]} for lp in logprobs]


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token: the admin token on Admin calls, the API key on Inference calls,
    so neither travels where it isn't needed."""
    return () if token is None else (("authorization", f"Bearer {token}"),)


def session_metadata(session_id: int) -> tuple[tuple[str, str], ...]:
    """`x-session-id`, the key a proxy hashes to send every call of a session to one replica (none for 0)."""
    return (("x-session-id", str(session_id)),) if session_id else ()


def new_session_id() -> int:
    """A random id in [1, 2^63): a collision with another open session is as likely as guessing it."""
    return secrets.randbits(63) or 1


def _logprob(lp: pb.TokenLogprob | pb.TopLogprob) -> dict[str, Any]:
    return {"token_id": lp.token_id, "token": lp.token, "logprob": lp.logprob}
