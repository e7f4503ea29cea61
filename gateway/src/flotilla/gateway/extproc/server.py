"""The picker's gRPC server (grpc.aio): the ExternalProcessor, the engines' endpoints (EDS) and the Health
service on one port, on the event loop the gateway's fleet and relay run on, so both data paths share one
front door. Only callers with the picker's credential are answered (extproc/callers.py)."""

from __future__ import annotations

import grpc

from flotilla.contract import picker_token, token_digest
from flotilla.gateway.admission import FrontDoor
from flotilla.gateway.extproc import health
from flotilla.gateway.extproc.callers import PickerCallers
from flotilla.gateway.extproc.endpoints import EndpointDiscovery, EndpointPublisher
from flotilla.gateway.extproc.protos import (
    add_EndpointDiscoveryServiceServicer_to_server,
    add_ExternalProcessorServicer_to_server,
)
from flotilla.gateway.extproc.responses import endpoint_address
from flotilla.gateway.extproc.servicer import Picker
from flotilla.gateway.fleet import Fleet

GRACE_SECONDS = 5.0  # streams in flight get this long to end when the picker stops


def engine_addresses(fleet: Fleet) -> set[str]:
    """Every replica the fleet knows, ready or not yet (a replica is in Envoy's cluster before it is picked)."""
    return {endpoint_address(e.url) for s in fleet.index.services() for e in s.endpoints}


class PickerServer:
    def __init__(self, door: FrontDoor, host: str, port: int) -> None:
        self.door, self.host, self.port = door, host, port
        self.server: grpc.aio.Server | None = None
        self.endpoints: EndpointPublisher | None = None

    async def start(self) -> int:
        """Listens (port 0: any free port) and returns the port; call on the serving loop."""
        master = self.door.settings.engine_token_master
        # With the master token, only callers with the picker's credential (extproc/callers.py).
        interceptors = [PickerCallers(token_digest(picker_token(master)))] if master else []
        server = grpc.aio.server(interceptors=interceptors)
        door = self.door
        publisher = self.endpoints = EndpointPublisher(lambda: engine_addresses(door.fleet))
        door.fleet_listeners.append(publisher.refresh)
        publisher.refresh()
        add_ExternalProcessorServicer_to_server(Picker(door, publisher), server)
        add_EndpointDiscoveryServiceServicer_to_server(EndpointDiscovery(publisher), server)
        server.add_generic_rpc_handlers((health.handler(self.door.fleet.synced.is_set),))
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        self.port = server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"the picker cannot listen on {address}")
        await server.start()
        self.server = server
        return self.port

    async def stop(self) -> None:
        if self.endpoints is not None and self.endpoints.refresh in self.door.fleet_listeners:
            self.door.fleet_listeners.remove(self.endpoints.refresh)
        if self.server is not None:
            await self.server.stop(GRACE_SECONDS)
            self.server = None
