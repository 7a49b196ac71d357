"""Client-side routing over several replicas without a proxy: one channel whose calls grpcio spreads by ring
hash on `x-session-id` (gRFC A76), so a session's calls reach one replica and stateless calls go anywhere."""

from __future__ import annotations

import ipaddress
import json
import os
from typing import Sequence

# grpcio hashes a request header only with this set; the client sets it, before its first ring-hash channel,
# unless the process has set it already.
RING_HASH_FLAG = "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"
# Each replica's health is watched (the Inference service's: NOT_SERVING while asleep or draining), and the
# ring hash skips a replica that is not serving, as a proxy's health checks do.
SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"ring_hash_experimental": {"requestHashHeader": "x-session-id"}}],
        "healthCheckConfig": {"serviceName": "lmgate.v1.Inference"},
    }
)

Target = str | Sequence[str]


def channel_target(target: Target) -> tuple[str, list[tuple[str, str]]]:
    """The channel's target and options: a string as it is; several "ip:port" addresses as one ring-hash
    channel over them. (A DNS name with several addresses works too: pass "dns:///name:port" and the options
    of `ring_hash_options()`.)"""
    if isinstance(target, str):
        return target, []
    if not target:
        raise ValueError("no target address")
    hosts = [_ip(address) for address in target]
    scheme = "ipv6" if all(ip.version == 6 for ip in hosts) else "ipv4"
    if any(ip.version != hosts[0].version for ip in hosts):
        raise ValueError(f"mixed IPv4 and IPv6 addresses: {list(target)}")
    return f"{scheme}:{','.join(target)}", ring_hash_options()


def ring_hash_options() -> list[tuple[str, str]]:
    os.environ.setdefault(RING_HASH_FLAG, "true")
    return [("grpc.service_config", SERVICE_CONFIG)]


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    host, sep, port = address.rpartition(":")
    try:
        if not sep or not port.isdigit():
            raise ValueError
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ValueError(f"several targets must each be 'ip:port' ('[ip]:port' for IPv6), got {address!r}") from None
