"""The gRPC health checking protocol (grpc.health.v1.Health: Check and Watch) on the picker's port, as
GIE's endpoint picker protocol asks: `liveness` is SERVING while the process answers; `readiness`, the
ExternalProcessor service's own name and the overall "" are SERVING once the fleet's watches have synced.

grpcio's own health package (grpcio-health-checking) is not a dependency: the protocol's two messages
are built here from their descriptor (grpc/health/v1/health.proto: one string field, one enum field),
in a private descriptor pool, so the wire format is the standard's and nothing global is registered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pool, message_factory

from flotilla.gateway.extproc.protos import FieldDescriptorProto, FileDescriptorProto

SERVICE = "grpc.health.v1.Health"
LIVENESS, READINESS = "liveness", "readiness"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3
WATCH_INTERVAL = 1.0  # seconds between two looks at the status for a Watch


def _messages() -> tuple[Any, Any]:
    field = FieldDescriptorProto
    proto = FileDescriptorProto(name="grpc/health/v1/health.proto", package="grpc.health.v1",
                                               syntax="proto3")  # fmt: skip
    request = proto.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    response = proto.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for name, number in (("UNKNOWN", UNKNOWN), ("SERVING", SERVING), ("NOT_SERVING", NOT_SERVING),
                         ("SERVICE_UNKNOWN", SERVICE_UNKNOWN)):  # fmt: skip
        status.value.add(name=name, number=number)
    response.field.add(name="status", number=1, type=field.TYPE_ENUM, label=field.LABEL_OPTIONAL,
                       type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus")  # fmt: skip
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")),
    )


HealthCheckRequest, HealthCheckResponse = _messages()


def status_of(service: str, ready: bool) -> int | None:
    """The status of a named service; None for a name the picker does not serve."""
    if service == LIVENESS:
        return SERVING
    if service in ("", READINESS, EXT_PROC_SERVICE):
        return SERVING if ready else NOT_SERVING
    return None


def handler(ready: Callable[[], bool]) -> grpc.GenericRpcHandler:
    """The Health service for a grpc.aio server; `ready()` says whether the picker can serve requests."""

    async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = status_of(request.service, ready())
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=status)

    async def watch(request: Any, _context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        last = None
        while True:
            status = status_of(request.service, ready())
            status = SERVICE_UNKNOWN if status is None else status
            if status != last:
                last = status
                yield HealthCheckResponse(status=status)
            await asyncio.sleep(WATCH_INTERVAL)

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Check": grpc.unary_unary_rpc_method_handler(
                check, HealthCheckRequest.FromString, HealthCheckResponse.SerializeToString
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                watch, HealthCheckRequest.FromString, HealthCheckResponse.SerializeToString
            ),
        },
    )
