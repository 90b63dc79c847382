"""The standard gRPC health service (``grpc.health.v1``), both sides: what a server says and
what a caller asks. The only place in KDN its messages are built or read."""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio


class Health:
    """A server's health service: NOT_SERVING until :meth:`serving`, then SERVING."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._servicer = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    async def serving(self, *services: str) -> None:
        """Say SERVING for the server as a whole ("") and for each of ``services``."""
        for name in ("", *services):
            await self._servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def shutdown(self) -> None:
        await self._servicer.enter_graceful_shutdown()


async def check(channel: Any, *, timeout: float) -> bool:
    """Whether the server behind ``channel`` says SERVING within ``timeout`` (``grpc.RpcError``
    when the call itself fails)."""
    resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


async def healthy(channel: Any, *, timeout: float) -> bool:
    """:func:`check`, False when the call fails."""
    try:
        return await check(channel, timeout=timeout)
    except grpc.RpcError:
        return False
