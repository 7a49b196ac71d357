"""`run_node`: the ranks of a machine past the first (`lmgate serve --nnodes N --node-rank K`).

Node 0's serving process publishes each other node's `RankSpec`s in its TCPStore (process_ranks.py); this
process fetches its own, spawns them as node 0 spawns its share, and waits for them. It serves nothing:
requests, outputs and collectives go between the ranks and node 0 directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import multiprocessing
import pickle
import signal
from multiprocessing.connection import wait
from typing import cast

from torch.distributed import TCPStore

from ..config import EngineConfig
from ..errors import InvalidRequest
from ..machine.threads import available_cpus
from .process_ranks import NNODES_KEY, node_failed_key, node_specs_key
from .rank_process import HEARTBEAT_SECONDS, RankSpec, run_rank

log = logging.getLogger(__name__)

JOIN_TIMEOUT = datetime.timedelta(minutes=10)  # for node 0 to come up and publish this node's ranks


def fetch_specs(config: EngineConfig) -> tuple[TCPStore, list[RankSpec]]:
    """Node 0's store, and this node's ranks as node 0 published them, with this machine's own CPUs shared
    between them."""
    store = TCPStore(config.master_addr, config.master_port, is_master=False, timeout=JOIN_TIMEOUT)
    nnodes = int(store.get(NNODES_KEY))
    if nnodes != config.nnodes:
        raise InvalidRequest(
            f"node 0 at {config.master_addr}:{config.master_port} serves {nnodes} nodes, not --nnodes {config.nnodes}"
        )
    specs: list[RankSpec] = pickle.loads(store.get(node_specs_key(config.node_rank)))
    threads = max(1, (config.threads or available_cpus()) // len(specs))
    return store, [dataclasses.replace(spec, num_threads=threads) for spec in specs]


def run_node(config: EngineConfig) -> int:
    """Exit status: 0 when every rank closed cleanly (node 0 shut down), 1 when one died or lost node 0.
    SIGINT or SIGTERM kills the ranks: node 0 sees them go silent and stops too.

    The store tells what the ranks cannot yet: a rank that fails is reported there (node 0 hears nothing from
    a remote rank until it is ready), and node 0's exit closes it (a rank waiting on peers that node 0 killed,
    before node 0 ever spoke to it, would wait for ever)."""
    store, specs = fetch_specs(config)
    spawn = multiprocessing.get_context("spawn")
    procs = [
        spawn.Process(target=run_rank, args=(spec,), name=f"lmgate-rank-{spec.rank}", daemon=True) for spec in specs
    ]
    for p in procs:
        p.start()
    log.info(
        "node %d of %d: ranks %s started as processes (pids %s), served by node 0 at %s",
        config.node_rank,
        config.nnodes,
        ", ".join(str(s.rank) for s in specs),
        ", ".join(str(p.pid) for p in procs),
        config.master_addr,
    )

    def stop(signum: int, _frame) -> None:
        log.info("node %d: %s, killing its ranks", config.node_rank, signal.Signals(signum).name)
        for p in procs:
            p.kill()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    running = {p.sentinel: p for p in procs}
    while running:
        ended = cast("list[int]", wait(list(running), timeout=HEARTBEAT_SECONDS))  # of the sentinels it was given
        for sentinel in ended:
            p = running.pop(sentinel)
            p.join()
            (log.info if p.exitcode == 0 else log.error)(
                "node %d: %s exited with status %s", config.node_rank, p.name, p.exitcode
            )
            if p.exitcode != 0:
                with contextlib.suppress(RuntimeError):  # node 0 has gone already
                    store.set(node_failed_key(config.node_rank), f"{p.name} exited with status {p.exitcode}")
        if not ended and not _reachable(store):
            log.error("node %d: node 0 at %s has gone; killing its ranks", config.node_rank, config.master_addr)
            for p in running.values():
                p.kill()
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def _reachable(store: TCPStore) -> bool:
    """False once node 0, and so its store, has gone."""
    try:
        store.check([NNODES_KEY])
        return True
    except RuntimeError:  # torch's DistNetworkError and DistStoreError derive from it
        return False
