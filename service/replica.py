"""Which replica answered: the `x-lmgate-replica` header on every response of lmgate's own services, so a
user behind a proxy can see where a call went."""

from __future__ import annotations

import socket

import grpc

HEADER = "x-lmgate-replica"
SESSION_HEADER = "x-session-id"  # the routing key clients send on a session's calls (see the proto)


def default_replica_id() -> str:
    return socket.gethostname()


class ReplicaHeaderInterceptor(grpc.aio.ServerInterceptor):
    """Sends the replica id as header metadata before a handler of `prefix` runs (health and reflection are
    left as they are); lmgate's services have no bidirectional streams."""

    def __init__(self, replica_id: str, prefix: str = "/lmgate.v1.") -> None:
        self._metadata = ((HEADER, replica_id),)
        self._prefix = prefix

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        metadata = self._metadata
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def stream(request, context: grpc.aio.ServicerContext):
                await context.send_initial_metadata(metadata)
                responses = inner_stream(request, context)
                if not hasattr(responses, "__aiter__"):  # a coroutine handler: it writes or aborts itself
                    await responses
                    return
                try:
                    async for response in responses:
                        yield response
                finally:
                    await responses.aclose()  # its cleanup runs now, not when the collector finds it

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:  # Admin.UpdateWeightsFromTensors
            inner_upload = handler.stream_unary

            async def upload(requests, context: grpc.aio.ServicerContext):
                await context.send_initial_metadata(metadata)
                return await inner_upload(requests, context)

            return grpc.stream_unary_rpc_method_handler(
                upload, handler.request_deserializer, handler.response_serializer
            )
        inner_unary = handler.unary_unary

        async def unary(request, context: grpc.aio.ServicerContext):
            await context.send_initial_metadata(metadata)
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
