"""Engine errors to gRPC status codes: the one place the mapping lives."""

from __future__ import annotations

import grpc

from lmgate.engine import errors

_CODES: dict[type[errors.EngineError], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ContextOverflow: grpc.StatusCode.OUT_OF_RANGE,
    errors.SessionNotFound: grpc.StatusCode.NOT_FOUND,
    errors.SessionExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.SessionBusy: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SessionStale: grpc.StatusCode.ABORTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.UnsupportedModel: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InternalError: grpc.StatusCode.INTERNAL,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Aborted: grpc.StatusCode.ABORTED,
}


def status_code(error: errors.EngineError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return grpc.StatusCode.INTERNAL


async def abort(context: grpc.aio.ServicerContext, error: errors.EngineError) -> None:
    """End the RPC with the error's status; never returns."""
    await context.abort(status_code(error), str(error))
