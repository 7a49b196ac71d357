"""Which engine loop holds each session, and which request is generating on it."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from .errors import SessionBusy, SessionExists, SessionNotFound
from .request import CancelFlag, Request


@dataclass(slots=True)
class Binding:
    rank: int
    active: Request | None = None  # the session's generating request, queued or running


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

    def clear(self) -> None:
        """Forget every session (sleep ends them all)."""
        with self._lock:
            self._bindings.clear()

    def claim(self, session_id: int, request: Request) -> int:
        """Mark `request` as the session's one active generation and return the session's rank. A cancelled
        turn whose last output is still on its way gives way: the next turn follows a Cancel (or a dropped
        stream) at once, and its loop ends the cancelled one before starting it (`EngineLoop._add_generate`)."""
        with self._lock:
            b = self._bindings.get(session_id)
            if b is None:
                raise SessionNotFound(f"session {session_id} not found (never started, or ended)")
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
                b.active = None
