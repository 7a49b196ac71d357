"""Who may call the Admin service: the bearer of the admin token, or, with none configured, loopback peers."""

from __future__ import annotations

import hmac
import ipaddress
import urllib.parse
from typing import Any, Callable

import grpc


def is_loopback_peer(peer: str) -> bool:
    """gRPC peer strings: 'ipv4:127.0.0.1:5000', 'ipv6:[::1]:5000' (grpcio percent-encodes the brackets:
    'ipv6:%5B::1%5D:5000'), 'unix:/path' (a local socket)."""
    peer = urllib.parse.unquote(peer)
    if peer.startswith("unix:") or peer.startswith("unix-abstract:"):
        return True
    for prefix in ("ipv4:", "ipv6:"):
        if peer.startswith(prefix):
            host = peer[len(prefix) :].rsplit(":", 1)[0].strip("[]")
            try:
                return ipaddress.ip_address(host).is_loopback
            except ValueError:
                return False
    return False


def bearer_token(metadata) -> str | None:
    """The credential of 'authorization: Bearer <credential>' among `metadata` (the scheme in any case, as
    RFC 7235 has it), else None."""
    scheme, _, credential = dict(metadata or ()).get("authorization", "").partition(" ")
    return credential if scheme.lower() == "bearer" and credential else None


def same_secret(sent: str | None, secret: str) -> bool:
    """In constant time, so that the time taken tells nothing of how much of the secret was right."""
    return sent is not None and hmac.compare_digest(sent.encode(), secret.encode())


def admin_denial(context: grpc.aio.ServicerContext, token: str | None) -> tuple[grpc.StatusCode, str] | None:
    """The status to refuse this Admin call with, or None to let it through."""
    if token is None:
        if is_loopback_peer(context.peer()):
            return None
        return (
            grpc.StatusCode.PERMISSION_DENIED,
            "Admin calls are accepted from loopback only unless --admin-token is set",
        )
    sent = bearer_token(context.invocation_metadata())
    if sent is None:
        return grpc.StatusCode.UNAUTHENTICATED, "Admin calls need 'authorization: Bearer <token>' metadata"
    if not same_secret(sent, token):
        return grpc.StatusCode.PERMISSION_DENIED, "wrong admin token"
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Inference calls (of either protocol) must carry 'authorization: Bearer <api key>' (compared in constant
    time); Admin has its own token, and health and reflection stay open for load balancers and tools."""

    def __init__(
        self,
        api_key: str,
        services: tuple[str, ...],
        on_refused: Callable[[str, Any, grpc.aio.ServicerContext], None] = lambda *_: None,
    ) -> None:
        """`services`: those whose calls need the key (lmgate.v1's Inference, the gateway's worker protocol);
        `on_refused(method, request, context)`: told of each call refused, to count and log it."""
        self._api_key = api_key
        self._prefixes = tuple(f"/{service}/" for service in services)
        self._on_refused = on_refused

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefixes):
            return handler
        sent = bearer_token(details.invocation_metadata)
        if same_secret(sent, self._api_key):
            return handler
        message = "missing API key: send 'authorization: Bearer <key>'" if sent is None else "wrong API key"

        async def refuse(request, context: grpc.aio.ServicerContext):
            self._on_refused(details.method, request, context)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                refuse, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)
