"""The engine's small set of errors; `service/` alone maps them to gRPC status codes."""


class EngineError(Exception):
    """Base of every error the engine reports to a caller."""


class InvalidRequest(EngineError):
    """Malformed or out-of-range input: empty prompt, bad sampling value, unknown token id."""


class ContextOverflow(EngineError):
    """Prompt plus requested tokens do not fit the context window."""


class SessionNotFound(EngineError):
    """The session was never started, or has ended."""


class SessionExists(EngineError):
    """A session with this id is already open."""


class SessionBusy(EngineError):
    """The session already has an active generation; turns never interleave."""


class SessionStale(EngineError):
    """The turn names a copy of the session (its epoch) other than the one here: the session was started
    again elsewhere, and this copy's history is not the caller's."""


class Unavailable(EngineError):
    """The engine is sleeping, shutting down or not ready; retry later."""


class ResourceExhausted(EngineError):
    """A queue or the KV cache cannot take this request."""


class UnsupportedModel(EngineError):
    """The checkpoint's architecture or format is not one the engine runs."""


class InternalError(EngineError):
    """A step of the engine failed; the streams it touched end with this error instead of hanging."""


class FailedPrecondition(EngineError):
    """The call does not fit the engine's state now: a weight group is already made, or none is."""


class DeadlineExceeded(EngineError):
    """A peer outside the engine did not answer in time: a trainer that never joins its weight group."""


class Aborted(EngineError):
    """Work with a peer outside the engine broke off (a trainer gone mid-broadcast); nothing changed."""
