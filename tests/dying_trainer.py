"""A trainer that dies mid-broadcast, for tests/test_weight_group.py. `python -m tests.dying_trainer BUCKET_BYTES`
serves a weight group's store on a free port of 127.0.0.1 and prints it, makes rank 0's side of the group with
the server at rank 1, waits until the server is ready for an update, broadcasts one bucket, prints "sent" and
waits to be killed. It follows docs/rl.md's protocol with torch.distributed alone, as a trainer written
without lmgate's client would."""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BroadcastOptions

from lmgate.client.weight_group import GROUP_PREFIX, ready_key

LIMIT = datetime.timedelta(seconds=60)  # a guard against a test that never calls, not a bound of the test


def main(bucket_bytes: int) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=LIMIT)
    print(store.port, flush=True)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = LIMIT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = dist.ProcessGroupGloo(dist.PrefixStore(GROUP_PREFIX, store), 0, 2, options)
    store.wait([ready_key(1)])
    broadcast = BroadcastOptions()
    broadcast.rootRank = 0
    group.broadcast([torch.zeros(bucket_bytes, dtype=torch.uint8)], broadcast).wait()
    print("sent", flush=True)
    sys.stdin.read()  # until killed


if __name__ == "__main__":
    main(int(sys.argv[1]))
