#!/bin/sh
# The Shepherd Model Gateway (smg 1.13, PyPI `smg`) in front of several lmgate replicas: the OpenAI API
# (/v1/chat/completions, /v1/completions, /v1/responses) over a fleet. smg speaks the VllmEngine worker protocol
# to each replica on its lmgate port, tokenizes and renders chat templates itself, and picks a replica for each
# request:
#   - cache-aware by default: a prompt goes to the replica whose prefix cache holds the longest part of it (from
#     lmgate's KV events, docs/gateway.md), else to the least loaded;
#   - sticky on a header: every request that carries `x-smg-routing-key: <conversation id>` goes to the replica
#     its key's first request went to, so each turn of a conversation finds the earlier turns' KV in that
#     replica's prefix cache (usage.prompt_tokens_details.cached_tokens). A request without it is routed
#     cache-aware. With the openai SDK: extra_headers={"x-smg-routing-key": conversation_id}.
#
# Usage: deploy/smg-fleet.sh HOST:PORT [HOST:PORT ...] [-- SMG_FLAG ...]
#   HOST:PORT      each replica's lmgate address (`lmgate serve --host ... --port ...`)
#   SMG_FLAG ...   more `smg launch` flags, e.g. --api-key KEY; a flag given here overrides the same one below
# Environment:
#   SMG                the smg launcher (default: smg on the PATH; `make install` puts it in .venv/bin)
#   SMG_HOST           the address the OpenAI API and the metrics listen on (default 127.0.0.1; 0.0.0.0 for
#                      every address, then protect the API with -- --api-key KEY)
#   SMG_PORT           the OpenAI API's port (default 8000)
#   SMG_METRICS_PORT   smg's Prometheus /metrics port (default 29000)
# Example: deploy/smg-fleet.sh 10.0.0.1:50051 10.0.0.2:50051 -- --api-key "$KEY"
#
# Health: smg calls each replica's HealthCheck every second (its default is a minute). lmgate answers
# healthy=false while it sleeps (Admin.Sleep, e.g. for a weight update), drains for shutdown or has lost a
# rank; two failed checks take the replica out of routing and one good check puts it back. A request that
# reaches a sleeping replica before that gets 503 from it, and smg retries it on another replica, so clients
# see no error. Send Sleep, Wakeup and UpdateWeights to each replica's own address, never through smg.
#
# CPU replicas: smg 1.13's liveness veto takes a replica out of routing once it has sent no token for
# --worker-wedge-secs (default 3) while requests pile up on it. On a CPU a long prompt takes longer than that to
# prefill, and what arrives meanwhile waits behind it, so a healthy replica is vetoed, and a sticky conversation
# whose turn comes during the veto is pinned to another replica for good, its history recomputed there. Measured
# on a 2-core AMD EPYC with the embedded model (benchmarks/smg_liveness.py, docs/gateway.md), a 2181-token turn
# took 3.2 s to prefill on one replica of 2 threads and 4.7-18 s on each of two replicas of 1 thread; with the
# default 3 s smg vetoed the busy replica in every run and moved one or two of the six conversations pinned to
# it; with 60 s it vetoed none (no request failed either way). So a CPU fleet sets the veto above its longest
# prefill, below; a GPU fleet may drop the flag and keep smg's 3 s. smg's overload veto (8 waiting requests, or
# 0.8 of the KV cache in use, from lmgate's GetLoads) stays: it is real load; raise
# --worker-overload-waiting-requests where conversations must never leave their replica.
set -eu

smg=${SMG:-smg}
workers=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    workers="$workers grpc://$1"
    shift
done
if [ $# -gt 0 ]; then shift; fi  # the "--"
if [ -z "$workers" ]; then
    echo "usage: $0 HOST:PORT [HOST:PORT ...] [-- SMG_FLAG ...]" >&2
    exit 2
fi

# $workers is split into one URL per replica on purpose.
# shellcheck disable=SC2086
exec "$smg" launch \
    --host "${SMG_HOST:-127.0.0.1}" --port "${SMG_PORT:-8000}" \
    --worker-urls $workers \
    --policy cache_aware \
    --sticky-sessions --routing-key-headers x-smg-routing-key \
    --health-check-interval-secs 1 --health-failure-threshold 2 --health-success-threshold 1 \
    --worker-wedge-secs 60 \
    --prometheus-host "${SMG_HOST:-127.0.0.1}" --prometheus-port "${SMG_METRICS_PORT:-29000}" \
    "$@"
