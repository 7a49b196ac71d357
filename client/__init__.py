"""lmgate's Python client: `Client` (blocking) and `AsyncClient` (asyncio); failures raise `grpc.RpcError`."""

from .client import AsyncClient, AsyncSession, Client, Session, Tls
from .wire import Delta

__all__ = ["AsyncClient", "AsyncSession", "Client", "Delta", "Session", "Tls"]
