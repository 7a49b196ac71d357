"""Weights from the caller's memory as an `UpdateWeightsFromTensors` stream: a header, the bytes in chunks (or,
for a server on this machine, in a file of its shared memory the stream names), a commit. The messages are made
serialized: a chunk's is its field's tag and length before the bytes, one copy of them (a protobuf message
built and serialized copies them three times, and the embedded model's push took twice as long). Tensors are
read by duck typing (a torch tensor, or a numpy array): the client imports no torch."""

from __future__ import annotations

import sys
from typing import Any, Iterator, Mapping

from lmgate.v1 import lmgate_pb2 as pb

from .shared_memory import SharedMemoryFile

# Bytes per chunk message: a few MiB, under a server's default 4 MiB limit on a received message.
CHUNK_BYTES = 2 << 20

TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


UPLOAD_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Admin'].full_name}/UpdateWeightsFromTensors"
COMMIT = pb.UpdateWeightsFromTensorsRequest(commit=True).SerializeToString()
# A chunk message's tag (its field's number, wire type 2): what protobuf writes before a one-byte chunk's length.
CHUNK_TAG = pb.UpdateWeightsFromTensorsRequest(chunk=b"\0").SerializeToString()[:-2]


def weight_stream(
    named_tensors: Mapping[str, Any], version: str = "", chunk_bytes: int = CHUNK_BYTES, commit: bool = True
) -> Iterator[bytes]:
    """The stream's messages, serialized, made as they are sent: one tensor's bytes at a time are copied out. A
    head that is the embedding's very tensor (a tied model's `state_dict()`) is left out: the server serves it
    so. Without `commit`, all but the last message (COMMIT), which the caller sends when it chooses."""
    tensors = sent_tensors(named_tensors)
    yield _header(tensors, version)
    pending = bytearray()  # the start of the next chunk: a tensor's tail, which the next one's head fills up
    for tensor in tensors.values():
        data = _raw_bytes(tensor)
        at = 0
        if pending:
            at = min(chunk_bytes - len(pending), len(data))
            pending += data[:at]
            if len(pending) < chunk_bytes:
                continue
            yield chunk_message(pending)
            pending = bytearray()
        while len(data) - at >= chunk_bytes:
            yield chunk_message(data[at : at + chunk_bytes])
            at += chunk_bytes
        pending += data[at:]
    if pending:
        yield chunk_message(pending)
    if commit:
        yield COMMIT


def chunk_message(data: bytes | bytearray | memoryview) -> bytes:
    """`UpdateWeightsFromTensorsRequest(chunk=data)` serialized: the tag, the length as a varint, the bytes."""
    length, varint = len(data), bytearray()
    while length > 0x7F:
        varint.append(length & 0x7F | 0x80)
        length >>= 7
    varint.append(length)
    return b"".join((CHUNK_TAG, varint, data))


def shared_memory_stream(
    named_tensors: Mapping[str, Any],
    file: SharedMemoryFile,
    version: str = "",
    commit: bool = True,
    spare: bool = False,
) -> list[bytes]:
    """The stream's messages (serialized) for a server on this machine, the bytes written into `file` first (now, by this
    call; `spare`: as `SharedMemoryFile.write`'s): the header, the file's range, and (with `commit`) COMMIT.
    The file stays unchanged until the call that sends them returns."""
    tensors = sent_tensors(named_tensors)
    length = sum(t.nbytes for t in tensors.values())
    file.write((_raw_bytes(t) for t in tensors.values()), length, spare)  # a tensor's bytes at a time, as chunks
    named = pb.SharedMemoryBytes(name=file.name, offset=0, length=length)
    messages = [_header(tensors, version), pb.UpdateWeightsFromTensorsRequest(shared_memory=named).SerializeToString()]
    return messages + [COMMIT] if commit else messages


def sent_tensors(named_tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors an update sends, in order: all but a head that is the embedding's very tensor."""
    return {name: t for name, t in named_tensors.items() if not _tied_head(name, t, named_tensors)}


def _header(tensors: Mapping[str, Any], version: str) -> bytes:
    header = pb.WeightsHeader(weight_version=version, tensors=tensor_specs(tensors))
    return pb.UpdateWeightsFromTensorsRequest(header=header).SerializeToString()


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
