"""Who may ask the picker: a data plane that presents the picker's credential in the gRPC metadata
PICKER_TOKEN_METADATA (Flotilla's Envoy sends it from its bootstrap's `initial_metadata`; another GIE
gateway is admitted by configuring the same metadata on its ext_proc service). Any other caller of the
ext_proc or EDS service gets UNAUTHENTICATED before the picker reads a byte: it learns no endpoint, gets no
pick, and cannot subscribe to EDS. Health checks stay open (kubelets and load balancers probe them).

The picker holds only the credential's digest (contract.token_digest); a gateway without the master token
(a workstation, a static fleet) has no digest, and its picker answers anyone, as before.
"""

from __future__ import annotations

from typing import Any

import grpc

from flotilla.contract import ENVOY_NODE_METADATA, PICKER_TOKEN_METADATA, token_matches
from flotilla.gateway.extproc import health


def _as_dict(pairs: Any) -> dict[str, str]:
    """gRPC metadata (key, value) pairs as a dict: lower-case keys, text values only (binary ones end -bin)."""
    return {str(k).lower(): v for k, v in pairs or () if isinstance(v, str)}


def metadata(context: Any) -> dict[str, str]:
    """The call's metadata as a dict; {} for a context without any."""
    read = getattr(context, "invocation_metadata", None)
    return _as_dict(read() if callable(read) else None)


def envoy_node(context: Any) -> str | None:
    """The asking Envoy's node id (ENVOY_NODE_METADATA), or None when the caller names none."""
    return metadata(context).get(ENVOY_NODE_METADATA) or None


async def _unauthenticated(_requests: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        f"the endpoint picker answers only its data plane: the call needs the picker's credential in "
        f"the {PICKER_TOKEN_METADATA} metadata",
    )


REFUSED = grpc.stream_stream_rpc_method_handler(_unauthenticated)


class PickerCallers(grpc.aio.ServerInterceptor):
    """Refuses every call but a health check that lacks the credential whose digest is `digest`."""

    def __init__(self, digest: str) -> None:
        self.digest = digest

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        if handler_call_details.method.startswith(f"/{health.SERVICE}/"):
            return await continuation(handler_call_details)
        given = _as_dict(handler_call_details.invocation_metadata)
        if token_matches(given.get(PICKER_TOKEN_METADATA), self.digest):
            return await continuation(handler_call_details)
        return REFUSED
