"""The protobuf classes the picker uses: Envoy's (xds-protos) and protobuf's own well-known types. Their
modules build the classes at import time and ship no type stubs, so the type checker cannot see them;
named here once, as Any, the rest of the package imports them from this module."""

from __future__ import annotations

import importlib
from typing import Any


def _module(name: str) -> Any:
    return importlib.import_module(name)


_ext_proc = _module("envoy.service.ext_proc.v3.external_processor_pb2")
_base = _module("envoy.config.core.v3.base_pb2")

BodyMutation = _ext_proc.BodyMutation
BodyResponse = _ext_proc.BodyResponse
CommonResponse = _ext_proc.CommonResponse
HeaderMutation = _ext_proc.HeaderMutation
HeadersResponse = _ext_proc.HeadersResponse
HttpHeaders = _ext_proc.HttpHeaders
ImmediateResponse = _ext_proc.ImmediateResponse
ProcessingRequest = _ext_proc.ProcessingRequest
ProcessingResponse = _ext_proc.ProcessingResponse
StreamedBodyResponse = _ext_proc.StreamedBodyResponse
TrailersResponse = _ext_proc.TrailersResponse
# The body mode Envoy announces in a stream's first message (ProcessingRequest.protocol_config).
FULL_DUPLEX_STREAMED = _module(
    "envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2"
).ProcessingMode.FULL_DUPLEX_STREAMED
HeaderValue = _base.HeaderValue
HeaderValueOption = _base.HeaderValueOption
HttpStatus = _module("envoy.type.v3.http_status_pb2").HttpStatus
Duration = _module("google.protobuf.duration_pb2").Duration
Struct = _module("google.protobuf.struct_pb2").Struct
_descriptors = _module("google.protobuf.descriptor_pb2")
FieldDescriptorProto = _descriptors.FieldDescriptorProto
FileDescriptorProto = _descriptors.FileDescriptorProto
_services = _module("envoy.service.ext_proc.v3.external_processor_pb2_grpc")
ExternalProcessorServicer = _services.ExternalProcessorServicer
add_ExternalProcessorServicer_to_server = _services.add_ExternalProcessorServicer_to_server  # noqa: N816
# Endpoint discovery (EDS): the engines Envoy's override-host load balancing may pick (endpoints.py).
_address = _module("envoy.config.core.v3.address_pb2")
Address = _address.Address
SocketAddress = _address.SocketAddress
HealthStatus = _module("envoy.config.core.v3.health_check_pb2").HealthStatus
ClusterLoadAssignment = _module("envoy.config.endpoint.v3.endpoint_pb2").ClusterLoadAssignment
_components = _module("envoy.config.endpoint.v3.endpoint_components_pb2")
LbEndpoint = _components.LbEndpoint
LocalityLbEndpoints = _components.LocalityLbEndpoints
UpstreamEndpoint = _components.Endpoint
DiscoveryResponse = _module("envoy.service.discovery.v3.discovery_pb2").DiscoveryResponse
AnyMessage = _module("google.protobuf.any_pb2").Any
_eds = _module("envoy.service.endpoint.v3.eds_pb2_grpc")
EndpointDiscoveryServiceServicer = _eds.EndpointDiscoveryServiceServicer
add_EndpointDiscoveryServiceServicer_to_server = _eds.add_EndpointDiscoveryServiceServicer_to_server  # noqa: N816
