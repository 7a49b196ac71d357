"""Which engine loop holds each session, and which request is generating on it."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from ..errors import SessionBusy, SessionExists, SessionNotFound, SessionStale
from .request import CancelFlag, Request


@dataclass(slots=True)
class Binding:
    rank: int
    active: Request | None = None  # the session's generating request, queued or running
    # Which copy of the session this is: a Start draws it, and a turn that names another is refused, so a
    # client whose session was started again elsewhere never continues from this copy's history.
    epoch: int = field(default_factory=lambda: random.getrandbits(63))
    idle_since: float = field(default_factory=time.monotonic)  # when its last turn ended (or it started)


class SequenceBinding:
    """Thread-safe map session id -> engine rank. `_lock` guards `_bindings`; it is a leaf lock."""

    def __init__(self) -> None:
        self._bindings: dict[int, Binding] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._bindings)

    def find(self, session_id: int) -> int | None:
        with self._lock:
            b = self._bindings.get(session_id)
            return None if b is None else b.rank

    def bind(self, session_id: int, rank: int) -> None:
        with self._lock:
            if session_id in self._bindings:
                raise SessionExists(f"session {session_id} already exists")
            self._bindings[session_id] = Binding(rank)

    def unbind(self, session_id: int) -> Binding | None:
        """Forget the session; returns what it was bound to (its rank and active request), if anything."""
        with self._lock:
            return self._bindings.pop(session_id, None)

    def take_idle(self, cutoff: float) -> dict[int, Binding]:
        """Forget the sessions with no turn since `cutoff` (time.monotonic); what they were bound to. A turn
        claims a session under the same lock: it comes first (the session is busy) or finds it gone."""
        with self._lock:
            idle = {i: b for i, b in self._bindings.items() if b.active is None and b.idle_since < cutoff}
            for session_id in idle:
                del self._bindings[session_id]
            return idle

    def clear(self) -> None:
        """Forget every session (sleep ends them all)."""
        with self._lock:
            self._bindings.clear()

    def epoch(self, session_id: int) -> int:
        with self._lock:
            b = self._bindings.get(session_id)
            if b is None:
                raise SessionNotFound(f"session {session_id} not found (never started, or ended)")
            return b.epoch

    def claim(self, session_id: int, request: Request) -> int:
        """Mark `request` as the session's one active generation and return the session's rank. A cancelled
        turn whose last output is still on its way gives way: the next turn follows a Cancel (or a dropped
        stream) at once, and its loop ends the cancelled one before starting it (`EngineLoop._add_generate`)."""
        with self._lock:
            b = self._bindings.get(session_id)
            if b is None:
                raise SessionNotFound(f"session {session_id} not found (never started, or ended)")
            if request.session_epoch is not None and request.session_epoch != b.epoch:
                raise SessionStale(
                    f"session {session_id} here is not the copy of epoch {request.session_epoch} "
                    "(it was started again elsewhere): end it and start it again"
                )
            if b.active is not None and b.active.cancel_flag.value != CancelFlag.CANCELLED:
                raise SessionBusy(f"session {session_id} is already generating; cancel it or wait for it to finish")
            b.active = request
            return b.rank

    def active(self, session_id: int) -> Request | None:
        """The session's generating request, if any."""
        with self._lock:
            b = self._bindings.get(session_id)
            if b is None:
                raise SessionNotFound(f"session {session_id} not found (never started, or ended)")
            return b.active

    def release(self, session_id: int, request: Request) -> None:
        with self._lock:
            b = self._bindings.get(session_id)
            if b is not None and b.active is request:
                b.active, b.idle_since = None, time.monotonic()
