"""The trainer's side of a weight group: `WeightGroup` serves the group's torch.distributed store, holds rank
0, and broadcasts new weights to a server that joined at `rank_offset` (Admin.InitWeightUpdateGroup).

torch is the trainer's, already imported (`sys.modules`): the client imports none itself. The protocol a
trainer in another framework follows instead is in docs/rl.md; its store keys are those below, the same as
the server's (engine/loading/weight_group.py). Before it makes its side of the group, and before it
broadcasts an update, the trainer waits for the server's key in the store, or for the server's call to end:
a refused call (a bad tensor, a group already made, a credential) raises at once and nothing is broadcast,
so neither side waits for a peer that will not come.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import math
import sys
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import grpc

from lmgate.v1 import lmgate_pb2 as pb

from .weights import sent_tensors, tensor_specs

if TYPE_CHECKING:
    from .client import Client

DEFAULT_BUCKET_BYTES = 512 << 20
GROUP_PREFIX = "lmgate/weights/group"  # the process group's keys in the store
POLL_SECONDS = 0.05  # between looks at the store while the server's call runs


def joined_key(rank: int) -> str:
    return f"lmgate/weights/joined/{rank}"


def ready_key(rank: int) -> str:
    return f"lmgate/weights/ready/{rank}"


def init_request(
    master_address: str, master_port: int, world_size: int, rank_offset: int, backend: str, timeout_seconds: int
) -> pb.InitWeightUpdateGroupRequest:
    return pb.InitWeightUpdateGroupRequest(
        master_address=master_address,
        master_port=master_port,
        world_size=world_size,
        rank_offset=rank_offset,
        backend=backend,
        timeout_seconds=timeout_seconds,
    )


def update_request(
    tensors: Sequence[pb.TensorSpec], version: str, bucket_bytes: int
) -> pb.UpdateWeightsFromDistributedRequest:
    return pb.UpdateWeightsFromDistributedRequest(weight_version=version, tensors=tensors, bucket_bytes=bucket_bytes)


class WeightGroup:
    """`with WeightGroup(client, "10.0.0.5", 29500) as group: group.push(model.state_dict(), "step-7")`.

    Entering serves the store at master_address:master_port (an address of this machine the server reaches;
    port 0: any free one, then in `master_port`) and makes the group with the server; `push` sends a whole model's weights and returns the version served;
    leaving destroys the group on both sides. `timeout` (seconds) bounds the join and each broadcast, on both
    sides. A push the server refuses (INVALID_ARGUMENT) raises its grpc.RpcError and the group stays; a push
    that fails once broadcasting started leaves the group destroyed on both sides: leave and make a new one.

    Used by one thread; the server's calls run on a thread of its own (`_calls`) while this one broadcasts.
    """

    def __init__(
        self,
        client: Client,
        master_address: str,
        master_port: int,
        backend: str = "gloo",
        timeout: float = 60,
        world_size: int = 2,
        rank_offset: int = 1,
    ) -> None:
        self.client = client
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.timeout = backend, timeout
        self.world_size, self.rank_offset = world_size, rank_offset
        self._torch = _torch()
        self._calls = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmgate-weight-group")
        self._store: Any = None
        self._group: Any = None
        self._init: concurrent.futures.Future | None = None  # the server's InitWeightUpdateGroup
        self._device = self._torch.device("cpu")
        self._bucket: Any = None  # the host buffer `_buckets` packs into, kept from one push to the next

    def __enter__(self) -> WeightGroup:
        dist, limit = self._torch.distributed, datetime.timedelta(seconds=self.timeout)
        try:
            self._store = dist.TCPStore(
                self.master_address, self.master_port, is_master=True, wait_for_workers=False, timeout=limit
            )
            self.master_port = self._store.port  # the one bound, where 0 asked for any free one
            self._init = self._calls.submit(
                self.client.init_weight_group,
                self.master_address,
                self.master_port,
                world_size=self.world_size,
                rank_offset=self.rank_offset,
                backend=self.backend,
                timeout_seconds=math.ceil(self.timeout),
            )
            self._await_server(self._init, joined_key(self.rank_offset))
            try:
                self._group = self._make_group(limit)
            except Exception as exc:  # the server's status says more than gloo's timeout, where it has one
                _raise_server_error(self._init, self.timeout, exc)
                raise
            self._init.result()
        except BaseException:
            self._close(quiet=True)
            raise
        return self

    def push(
        self, named_tensors: Mapping[str, Any], version: str = "", bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> str:
        """Every weight of the model by Hugging Face name (a `state_dict()`; a tied head that is the embedding's
        very tensor is left out), float32, float16 or bfloat16: the server serves them as `version` (empty: it
        counts), which is returned once they serve."""
        if self._group is None:
            raise RuntimeError("the weight group is not made, or a failed push destroyed it: make a new one")
        tensors = sent_tensors(named_tensors)
        update = self._calls.submit(
            self.client.update_weights_from_distributed, tensor_specs(tensors), version, bucket_bytes
        )
        try:
            self._await_server(update, ready_key(self.rank_offset))  # a refusal raises here: nothing broadcast
        except grpc.RpcError:
            raise
        except BaseException:  # no answer in time: the server may yet wait for buckets that will not come
            self._drop_group()
            raise
        try:
            for bucket in self._buckets(list(tensors.values()), bucket_bytes):
                self._broadcast(bucket)
        except BaseException as exc:
            self._drop_group()  # the server's receive sees its peer close, and destroys its side
            if isinstance(exc, Exception):
                _raise_server_error(update, self.timeout, exc)
            raise
        return update.result()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._close(quiet=exc_type is not None)

    def _await_server(self, call: concurrent.futures.Future, key: str) -> None:
        """Until the server sets `key` in the store, or its `call` ends: a refusal raises its error here. The
        key is then removed, so the next call waits for its own."""
        deadline = time.monotonic() + self.timeout
        try:
            while not self._store.check([key]):
                try:
                    call.result(timeout=POLL_SECONDS)
                except concurrent.futures.TimeoutError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the server did not answer within {self.timeout:g}s") from None
                    continue
                raise RuntimeError(f"the server's call ended without setting {key!r}")
        finally:
            self._store.delete_key(key)

    def _make_group(self, limit: datetime.timedelta) -> Any:
        """Rank 0's side of the group over the store; returns once every rank has made its own."""
        dist = self._torch.distributed
        prefixed = dist.PrefixStore(GROUP_PREFIX, self._store)
        if self.backend == "nccl":
            self._device = self._torch.device("cuda", self._torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = limit
            group = dist.ProcessGroupNCCL(prefixed, 0, self.world_size, options)
            group.eager_connect_single_device(self._device)  # as the server does: joined means joined
            return group
        options = dist.ProcessGroupGloo._Options()
        options._timeout = limit
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.master_address)]
        return dist.ProcessGroupGloo(prefixed, 0, self.world_size, options)

    def _buckets(self, tensors: list[Any], bucket_bytes: int) -> Iterator[Any]:
        """The tensors' bytes, row-major and packed, in one buffer of `bucket_bytes` (the last shorter), the same from
        one push to the next (each bucket's broadcast has ended before the next is packed)."""
        torch = self._torch
        total = sum(t.numel() * t.element_size() for t in tensors)
        size = min(bucket_bytes, total)
        buffer = self._bucket
        if buffer is None or buffer.numel() != size:
            self._bucket = None
            buffer = torch.empty(size, dtype=torch.uint8, device=self._device)
            # Kept in host memory, where a new buffer's pages are faulted in at each push (0.3 s for 512 MiB on
            # the 2-core EPYC); a GPU's caching allocator hands memory out again at once, and training wants it.
            self._bucket = buffer if buffer.device.type == "cpu" else None
        filled, sent = 0, 0
        for tensor in tensors:
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            at = 0
            while at < data.numel():
                size = min(bucket_bytes, total - sent)
                n = min(size - filled, data.numel() - at)
                buffer[filled : filled + n].copy_(data[at : at + n])
                filled, at = filled + n, at + n
                if filled == size:
                    yield buffer[:size]
                    filled, sent = 0, sent + size

    def _broadcast(self, bucket: Any) -> None:
        options = self._torch.distributed.distributed_c10d.BroadcastOptions()
        options.rootRank, options.timeout = 0, datetime.timedelta(seconds=self.timeout)
        self._group.broadcast([bucket], options).wait()

    def _drop_group(self) -> None:
        group, self._group = self._group, None
        if group is not None and self.backend == "nccl":
            group.shutdown()

    def _close(self, quiet: bool) -> None:
        """This side's group and store first (a server still receiving or joining sees them close), then the
        server's group, once its Init has ended, if that made one: a refused Init's server may hold another
        trainer's. `quiet`: while an error propagates, a failed Destroy (the server gone) does not replace it."""
        self._drop_group()
        self._store = self._bucket = None
        init, self._init = self._init, None
        try:
            if init is not None and init.exception() is None:
                with contextlib.suppress(*((grpc.RpcError,) if quiet else ())):
                    self.client.destroy_weight_group()
        finally:
            self._calls.shutdown(wait=True)


def _raise_server_error(update: concurrent.futures.Future, timeout: float, cause: Exception) -> None:
    """The server's status for an update whose broadcast failed here (ABORTED, UNAVAILABLE), when it comes
    within `timeout`; else nothing, and the caller raises `cause`."""
    try:
        update.result(timeout=timeout)
    except grpc.RpcError as error:
        raise error from cause
    except concurrent.futures.TimeoutError:
        pass


def _torch() -> ModuleType:
    """The trainer's torch, already imported (torch.distributed with it): the client imports none itself."""
    torch = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError("WeightGroup sends torch tensors over torch.distributed: import torch first")
    return torch
