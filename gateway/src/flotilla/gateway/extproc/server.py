"""The picker's gRPC server (grpc.aio): the ExternalProcessor and the Health service on one port, on the
event loop the gateway's fleet and relay run on, so both data paths share one front door."""

from __future__ import annotations

import grpc

from flotilla.gateway.admission import FrontDoor
from flotilla.gateway.extproc import health
from flotilla.gateway.extproc.protos import add_ExternalProcessorServicer_to_server
from flotilla.gateway.extproc.servicer import Picker

GRACE_SECONDS = 5.0  # streams in flight get this long to end when the picker stops


class PickerServer:
    def __init__(self, door: FrontDoor, host: str, port: int) -> None:
        self.door, self.host, self.port = door, host, port
        self.server: grpc.aio.Server | None = None

    async def start(self) -> int:
        """Listens (port 0: any free port) and returns the port; call on the serving loop."""
        server = grpc.aio.server()
        add_ExternalProcessorServicer_to_server(Picker(self.door), server)
        server.add_generic_rpc_handlers((health.handler(self.door.fleet.synced.is_set),))
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        self.port = server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"the picker cannot listen on {address}")
        await server.start()
        self.server = server
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(GRACE_SECONDS)
            self.server = None
