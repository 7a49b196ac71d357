"""Who may call the Admin service: the bearer of the admin token, or, with none configured, loopback peers."""
from __future__ import annotations

import hmac
import ipaddress

import grpc


def is_loopback_peer(peer: str) -> bool:
    """gRPC peer strings: 'ipv4:127.0.0.1:5000', 'ipv6:[::1]:5000', 'unix:/path' (a local socket)."""
    if peer.startswith("unix:") or peer.startswith("unix-abstract:"):
        return True
    for prefix in ("ipv4:", "ipv6:"):
        if peer.startswith(prefix):
            host = peer[len(prefix):].rsplit(":", 1)[0].strip("[]")
            try:
                return ipaddress.ip_address(host).is_loopback
            except ValueError:
                return False
    return False


def admin_denial(context: grpc.aio.ServicerContext, token: str | None) -> tuple[grpc.StatusCode, str] | None:
    """The status to refuse this Admin call with, or None to let it through."""
    if token is None:
        if is_loopback_peer(context.peer()):
            return None
        return grpc.StatusCode.PERMISSION_DENIED, "Admin calls are accepted from loopback only unless --admin-token is set"
    sent = dict(context.invocation_metadata()).get("authorization")
    if sent is None:
        return grpc.StatusCode.UNAUTHENTICATED, "Admin calls need 'authorization: Bearer <token>' metadata"
    if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
        return grpc.StatusCode.PERMISSION_DENIED, "wrong admin token"
    return None
