"""Weights from the caller's memory as an `UpdateWeightsFromTensors` stream: a header, the bytes in chunks (or,
for a server on this machine, in a file of its shared memory the stream names), a commit. Tensors are read by
duck typing (a torch tensor, or a numpy array): the client imports no torch."""

from __future__ import annotations

import sys
from typing import Any, Iterator, Mapping

from lmgate.v1 import lmgate_pb2 as pb

from .shared_memory import SharedMemoryFile

# Bytes per chunk message: a few MiB, under a server's default 4 MiB limit on a received message.
CHUNK_BYTES = 2 << 20

TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


COMMIT = pb.UpdateWeightsFromTensorsRequest(commit=True)


def weight_stream(
    named_tensors: Mapping[str, Any], version: str = "", chunk_bytes: int = CHUNK_BYTES, commit: bool = True
) -> Iterator[pb.UpdateWeightsFromTensorsRequest]:
    """The stream's messages, made as they are sent: one tensor's bytes at a time are copied out. A head that is
    the embedding's very tensor (a tied model's `state_dict()`) is left out: the server serves it so. Without
    `commit`, all but the last message (COMMIT), which the caller sends when it chooses."""
    tensors = sent_tensors(named_tensors)
    header = pb.WeightsHeader(weight_version=version, tensors=tensor_specs(tensors))
    yield pb.UpdateWeightsFromTensorsRequest(header=header)
    pending = bytearray()  # the start of the next chunk: a tensor's tail, which the next one's head fills up
    for tensor in tensors.values():
        data = _raw_bytes(tensor)
        at = 0
        if pending:
            at = min(chunk_bytes - len(pending), len(data))
            pending += data[:at]
            if len(pending) < chunk_bytes:
                continue
            yield pb.UpdateWeightsFromTensorsRequest(chunk=bytes(pending))
            pending = bytearray()
        while len(data) - at >= chunk_bytes:
            yield pb.UpdateWeightsFromTensorsRequest(chunk=bytes(data[at : at + chunk_bytes]))
            at += chunk_bytes
        pending += data[at:]
    if pending:
        yield pb.UpdateWeightsFromTensorsRequest(chunk=bytes(pending))
    if commit:
        yield COMMIT


def shared_memory_stream(
    named_tensors: Mapping[str, Any],
    file: SharedMemoryFile,
    version: str = "",
    commit: bool = True,
    spare: bool = False,
) -> list[pb.UpdateWeightsFromTensorsRequest]:
    """The stream's messages for a server on this machine, the bytes written into `file` first (now, by this
    call; `spare`: as `SharedMemoryFile.write`'s): the header, the file's range, and (with `commit`) COMMIT.
    The file stays unchanged until the call that sends them returns."""
    tensors = sent_tensors(named_tensors)
    header = pb.WeightsHeader(weight_version=version, tensors=tensor_specs(tensors))
    length = sum(t.nbytes for t in tensors.values())
    file.write((_raw_bytes(t) for t in tensors.values()), length, spare)  # a tensor's bytes at a time, as chunks
    named = pb.SharedMemoryBytes(name=file.name, offset=0, length=length)
    messages = [
        pb.UpdateWeightsFromTensorsRequest(header=header),
        pb.UpdateWeightsFromTensorsRequest(shared_memory=named),
    ]
    return messages + [COMMIT] if commit else messages


def sent_tensors(named_tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors an update sends, in order: all but a head that is the embedding's very tensor."""
    return {name: t for name, t in named_tensors.items() if not _tied_head(name, t, named_tensors)}


def tensor_specs(tensors: Mapping[str, Any]) -> list[pb.TensorSpec]:
    """Each tensor's name, dtype and shape, as an update's header announces them."""
    return [pb.TensorSpec(name=name, dtype=_dtype(t), shape=list(t.shape)) for name, t in tensors.items()]


def _tied_head(name: str, tensor: Any, named: Mapping[str, Any]) -> bool:
    embedding = named.get(EMBEDDING)
    if name != TIED_HEAD or embedding is None or not hasattr(tensor, "data_ptr"):
        return False
    return tensor.data_ptr() == embedding.data_ptr() and tuple(tensor.shape) == tuple(embedding.shape)


def _dtype(tensor: Any) -> str:
    """ "float32", "bfloat16", ...: a torch dtype's name without its module, a numpy one's as it is."""
    return str(tensor.dtype).removeprefix("torch.")


def _raw_bytes(tensor: Any) -> memoryview:
    """The tensor's elements, row-major, in the machine's (little-endian) byte order: a torch tensor's as bytes
    (uint8, which numpy reads whatever the dtype, bfloat16 too: torch is the caller's, already loaded), a numpy
    array's as they are."""
    if hasattr(tensor, "untyped_storage"):
        torch = sys.modules[type(tensor).__module__.split(".")[0]]
        tensor = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return memoryview(tensor.tobytes(order="C") if not tensor.flags.c_contiguous else tensor).cast("B")
