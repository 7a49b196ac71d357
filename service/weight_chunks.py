"""UpdateWeightsFromTensors' requests as they arrive: a chunk's bytes handed over as a view of the received
message, neither parsed nor copied (a protobuf parse and the field's read copy 2 MiB twice, on the event loop
that receives the next); every other message parsed as usual."""

from __future__ import annotations

from typing import Awaitable, Callable

import grpc

from lmgate.v1 import lmgate_pb2 as pb

METHOD = f"/{pb.DESCRIPTOR.services_by_name['Admin'].full_name}/UpdateWeightsFromTensors"
# A chunk message's tag (its field's number, wire type 2): what protobuf writes before a one-byte chunk's length.
CHUNK_TAG = pb.UpdateWeightsFromTensorsRequest(chunk=b"\0").SerializeToString()[:-2]


def chunk_or_request(data: bytes) -> memoryview | pb.UpdateWeightsFromTensorsRequest:
    """A message that is one chunk field and nothing else (as every client sends a chunk): its bytes, a view of
    `data`; any other message parsed (a header, a commit, a chunk with more fields, one that is malformed)."""
    if data.startswith(CHUNK_TAG):
        length, at = 0, len(CHUNK_TAG)
        for shift in range(0, 64, 7):  # the length, a varint: 7 bits a byte, the last without its high bit
            if at == len(data):
                break
            byte = data[at]
            at += 1
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                if at + length == len(data):
                    return memoryview(data)[at:]
                break
    return pb.UpdateWeightsFromTensorsRequest.FromString(data)


class ChunkViewInterceptor(grpc.aio.ServerInterceptor):
    """Gives UpdateWeightsFromTensors' handler `chunk_or_request` as its deserializer (the generated code's parses
    every message)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method != METHOD or handler.stream_unary is None:  # None: a refusal's
            return handler
        return grpc.stream_unary_rpc_method_handler(handler.stream_unary, chunk_or_request, handler.response_serializer)
