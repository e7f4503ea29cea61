"""Envoy's bootstrap for Flotilla's data plane: one listener whose HTTP filters are ext_proc (to the picker,
over gRPC) and the router, as GIE's reference deployment wires it; the router's cluster holds the engines the
picker serves over EDS, balanced by override-host on the pick (and its fallback, for one retry), so Envoy
connects to exactly the engine picked. (GIE's reference uses an original-destination cluster, which can
neither retry elsewhere nor refuse an address the picker did not list.)
Pure: a dict, printed as JSON (which is YAML) by `flotilla gateway envoy-config`.

The processing mode: request headers SEND (API key, declared size: refused before the body is read), request
body BUFFERED (the picker needs the whole JSON to find the model and hash the prompt; the listener's buffer
limit is above the gateway's body limit, so the picker, not Envoy, answers an oversized body with its
OpenAI-shaped 413), response headers SEND (the status), response body STREAMED (the completion's events,
for the tenant's token charges; each chunk is passed on as soon as the picker has counted it), trailers
SKIP.

Timeouts: Envoy waits `message_timeout` for each answer of the picker; a request held for a replica asks
for more (up to `max_message_timeout`, the hold timeout and a margin). The route has no overall timeout (a
long generation is not an error); `idle_timeout` ends an upstream that stays silent that long.

Credentials, from the installation's master token (`master_token`; without it none): Envoy presents the
picker's credential (contract.picker_token) in the metadata of its ext_proc and EDS calls, with its node id
(each picker waits only for the asking Envoy's own EDS ACKs); its route adds the gateway's credential
(contract.gateway_token) to every upstream request, replacing any a client sent, so the picker never hands
a credential to anyone. Before the picker, a header mutation removes a client's own HEADER_TENANT: with
FailOpen and the picker down, a request passes on without a tenant, never with one the client chose.

The admin: on loopback by default (`flotilla gateway envoy` on a workstation), or on a unix socket
(`admin_pipe`, the chart's pod: the admin serves /quitquitquit and must not be on the pod's address, and a
socket in the pod's own volume cannot collide with another replica's as a loopback port can on the local
cluster, where pods share the host's network). With `stats_port`, a second listener serves only
`GET /stats/prometheus` and `GET /ready` of the admin, through a cluster to it: what Prometheus and the
kubelet's probe read, and nothing else.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from flotilla.contract import (
    DESTINATION_ENDPOINT_HEADER,
    DESTINATION_METADATA_NAMESPACE,
    ENVOY_CLIENTS_PREFIX,
    ENVOY_ENGINES_CLUSTER,
    ENVOY_NODE_METADATA,
    ENVOY_STATS_PATH,
    HEADER_GATEWAY_TOKEN,
    HEADER_TENANT,
    PICKER_TOKEN_METADATA,
    SUBSET_HINT_KEY,
    SUBSET_HINT_NAMESPACE,
    gateway_token,
    picker_token,
)
from flotilla.gateway.config import DEFAULT_MAX_BODY_BYTES, HOLD_MARGIN_SECONDS

BodyMode = Literal["BUFFERED", "FULL_DUPLEX_STREAMED"]
FailureMode = Literal["FailClose", "FailOpen"]
FAILURE_MODES: tuple[FailureMode, ...] = ("FailClose", "FailOpen")
# The engines' cluster and the clients' connection manager name Envoy's series the dashboards read (their
# `envoy_cluster_name` and `envoy_http_conn_manager_prefix`): the contract's names.
PICKER_CLUSTER, ENGINES_CLUSTER, ADMIN_CLUSTER = "flotilla_picker", ENVOY_ENGINES_CLUSTER, "flotilla_admin"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
LISTENER_STAT_PREFIX, STATS_STAT_PREFIX = ENVOY_CLIENTS_PREFIX, "flotilla_stats"
# What the stats listener passes to the admin: Envoy's series for Prometheus, and readiness for probes.
STATS_PATHS = (ENVOY_STATS_PATH, "/ready")
BUFFER_MARGIN = 64 * 1024  # bytes of listener buffer above the body limit: headers, and the 413's own read
# The status Envoy answers when the picker cannot be reached (FailClose): the service is unavailable, and
# an OpenAI client retries it.
PICKER_UNAVAILABLE = 503
_T = "type.googleapis.com/envoy."
DEFAULT_NODE_ID = "flotilla-gateway"  # the node's cluster, and its id where the caller names none
# Once, on the pick's fallback (the second address of the destination), for what the relay retries: an
# engine that refuses the connection, resets before its response starts, or answers 503 (full, draining).
# After the response has started nothing is retried (its first bytes are the client's).
RETRY_POLICY = {
    "retry_on": "connect-failure,refused-stream,reset,retriable-status-codes",
    "retriable_status_codes": [503],
    "num_retries": 1,
}
# Envoy's circuit breakers default to 3 retries in flight per cluster, so an engine that dies with a full
# queue would have all but 3 of its requests fail instead of going to their fallbacks; and to 1,024
# requests in flight, which would cap the picker's cluster (one ext_proc stream per request, for its whole
# life) and the engines' at 1,024 concurrent generations. Every request may retry once; requests are
# bounded by the engines' queues and the gateway's holds, not here.
ENGINE_CIRCUIT_LIMIT = 1 << 20
CIRCUIT_BREAKERS = {
    "thresholds": [{
        "priority": "DEFAULT",
        "max_connections": ENGINE_CIRCUIT_LIMIT,
        "max_pending_requests": ENGINE_CIRCUIT_LIMIT,
        "max_requests": ENGINE_CIRCUIT_LIMIT,
        "max_retries": ENGINE_CIRCUIT_LIMIT,
    }]
}  # fmt: skip


def _policy(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """A load-balancing policy extension, by its proto's name under load_balancing_policies."""
    extension = name.split(".")[0]
    return {"typed_extension_config": {
        "name": f"envoy.load_balancing_policies.{extension}",
        "typed_config": {"@type": f"{_T}extensions.load_balancing_policies.{name}", **config},
    }}  # fmt: skip


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _pipe(path: str) -> dict[str, Any]:
    return {"pipe": {"path": path}}


ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": _T + "extensions.filters.http.router.v3.Router"},
}


def _http_manager(stat_prefix: str, route_config: dict[str, Any], http_filters: list[dict[str, Any]],
                  **options: Any) -> dict[str, Any]:  # fmt: skip
    """An HTTP connection manager network filter: its stats under `stat_prefix`, its routes, its filters."""
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": stat_prefix,
            "codec_type": "AUTO",
            **options,
            "route_config": route_config,
            "http_filters": http_filters,
        },
    }


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def processing_mode(body_mode: BodyMode) -> dict[str, str]:
    """BUFFERED: Flotilla's (see the module's docstring). FULL_DUPLEX_STREAMED: GIE's reference mode, which
    other GIE gateways configure: both bodies stream through the picker, trailers too."""
    if body_mode == "FULL_DUPLEX_STREAMED":
        return {"request_header_mode": "SEND", "request_body_mode": body_mode, "request_trailer_mode": "SEND",
                "response_header_mode": "SEND", "response_body_mode": body_mode, "response_trailer_mode": "SEND"}  # fmt: skip
    if body_mode != "BUFFERED":
        raise ValueError(f"body_mode must be BUFFERED or FULL_DUPLEX_STREAMED, not {body_mode!r}")
    return {"request_header_mode": "SEND", "request_body_mode": "BUFFERED", "request_trailer_mode": "SKIP",
            "response_header_mode": "SEND", "response_body_mode": "STREAMED", "response_trailer_mode": "SKIP"}  # fmt: skip


def bootstrap(
    *,
    picker_host: str,
    picker_port: int,
    listen_host: str = "127.0.0.1",
    listen_port: int = 0,
    admin_host: str = "127.0.0.1",
    admin_port: int = 0,
    failure_mode: FailureMode = "FailClose",
    body_mode: BodyMode = "BUFFERED",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    message_timeout: float = 30.0,
    hold_timeout: float = 300.0,
    upstream_idle_timeout: float = 600.0,
    subset_hint: list[str] | None = None,
    admin_pipe: str | None = None,
    stats_host: str | None = None,
    stats_port: int | None = None,
    master_token: str | None = None,
    node_id: str = DEFAULT_NODE_ID,
) -> dict[str, Any]:
    """The bootstrap. Port 0 lets the kernel choose (EnvoyProcess reads the ports back from the admin).
    `subset_hint` sets GIE's subset hint on every request (the `envoy.lb.subset_hint` metadata a gateway
    controller sets per route): the picker then picks among those `ip:port` endpoints only.
    `admin_pipe`: the admin on this unix socket instead of `admin_host:admin_port`. `stats_port`: the
    stats listener (on `stats_host`, default `listen_host`), see the module's docstring. `master_token`
    and `node_id`: the credentials and the identity, see the module's docstring."""
    if failure_mode not in FAILURE_MODES:
        raise ValueError(f"failure_mode must be one of {', '.join(FAILURE_MODES)}, not {failure_mode!r}")
    ext_proc = {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": _picker_service(master_token, node_id),
            "failure_mode_allow": failure_mode == "FailOpen",
            "status_on_error": {"code": PICKER_UNAVAILABLE},
            "processing_mode": processing_mode(body_mode),
            "message_timeout": _duration(message_timeout),
            "max_message_timeout": _duration(hold_timeout + HOLD_MARGIN_SECONDS),
            "metadata_options": {"forwarding_namespaces": {"untyped": [SUBSET_HINT_NAMESPACE]}},
        },
    }
    filters: list[dict[str, Any]] = [_without_client_headers((HEADER_TENANT, HEADER_GATEWAY_TOKEN))]
    if subset_hint is not None:
        filters.append({
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": _T + "extensions.filters.http.set_metadata.v3.Config",
                "metadata": [{"metadata_namespace": SUBSET_HINT_NAMESPACE,
                              "value": {SUBSET_HINT_KEY: list(subset_hint)}}],
            },
        })  # fmt: skip
    filters += [ext_proc, ROUTER]
    connection_manager = _http_manager(
        LISTENER_STAT_PREFIX,
        {
            "name": "flotilla",
            "virtual_hosts": [{
                "name": "openai",
                "domains": ["*"],
                # The picker counts the retries (flotilla_gateway_retries) from this response header.
                "include_attempt_count_in_response": True,
                "routes": [{
                    "match": {"prefix": "/"},
                    "route": {"cluster": ENGINES_CLUSTER, "timeout": "0s",
                              "idle_timeout": _duration(upstream_idle_timeout),
                              "retry_policy": RETRY_POLICY},
                    **_gateway_credential(master_token),
                }],
            }],
        },
        filters,
        # A held request is silent until its replica is ready; a generation streams for long.
        stream_idle_timeout=_duration(hold_timeout + upstream_idle_timeout),
        request_timeout="0s",
    )  # fmt: skip
    picker_cluster = {
        "name": PICKER_CLUSTER,
        "type": "STATIC" if _is_ip(picker_host) else "STRICT_DNS",
        "connect_timeout": "1s",
        "circuit_breakers": CIRCUIT_BREAKERS,
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": PICKER_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket(picker_host, picker_port)}}]}],
        },
    }
    destination = [
        {"metadata": {"key": DESTINATION_METADATA_NAMESPACE, "path": [{"key": DESTINATION_ENDPOINT_HEADER}]}},
        {"header": DESTINATION_ENDPOINT_HEADER},
    ]
    engines_cluster = {
        "name": ENGINES_CLUSTER,
        "type": "EDS",
        "connect_timeout": "5s",
        "circuit_breakers": CIRCUIT_BREAKERS,
        # The engines, from the picker (extproc/endpoints.py): override-host picks only among them.
        "eds_cluster_config": {
            "eds_config": {
                "resource_api_version": "V3",
                "api_config_source": {
                    "api_type": "GRPC",
                    "transport_api_version": "V3",
                    "grpc_services": [_picker_service(master_token, node_id)],
                },
            }
        },
        "load_balancing_policy": {
            "policies": [
                _policy(
                    "override_host.v3.OverrideHost",
                    {
                        "override_host_sources": destination,
                        # Without a pick (FailOpen, the picker down): Envoy's own balancing over every engine.
                        "fallback_policy": {"policies": [_policy("least_request.v3.LeastRequest", {})]},
                    },
                )
            ]
        },
    }
    admin_address = _pipe(admin_pipe) if admin_pipe else _socket(admin_host, admin_port)
    listeners: list[dict[str, Any]] = [{
        "name": "flotilla",
        "address": _socket(listen_host, listen_port),
        "per_connection_buffer_limit_bytes": max_body_bytes + BUFFER_MARGIN,
        "filter_chains": [{"filters": [connection_manager]}],
    }]  # fmt: skip
    clusters = [picker_cluster, engines_cluster]
    if stats_port is not None:
        listeners.append(_stats_listener(stats_host or listen_host, stats_port))
        clusters.append({
            "name": ADMIN_CLUSTER,
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": ADMIN_CLUSTER,
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": admin_address}}]}],
            },
        })  # fmt: skip
    return {
        # xDS (the engines' EDS) needs a node identity; the picker keeps each node's ACKs apart.
        "node": {"id": node_id, "cluster": DEFAULT_NODE_ID},
        "admin": {"address": admin_address},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


def _picker_service(master_token: str | None, node_id: str) -> dict[str, Any]:
    """The picker as a gRPC service of Envoy's: with the picker's credential (when there is a master token)
    and this Envoy's node id in every call's metadata."""
    metadata = [{"key": ENVOY_NODE_METADATA, "value": node_id}]
    if master_token:
        metadata.insert(0, {"key": PICKER_TOKEN_METADATA, "value": picker_token(master_token)})
    return {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}, "initial_metadata": metadata}


def _gateway_credential(master_token: str | None) -> dict[str, Any]:
    """The route's own header: the gateway's credential on every upstream request (a client's is removed
    first: Envoy removes a route's headers_to_remove before it adds its headers_to_add)."""
    if not master_token:
        return {"request_headers_to_remove": [HEADER_GATEWAY_TOKEN.lower()]}
    return {
        "request_headers_to_remove": [HEADER_GATEWAY_TOKEN.lower()],
        "request_headers_to_add": [{
            "header": {"key": HEADER_GATEWAY_TOKEN.lower(), "value": gateway_token(master_token)},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }],
    }  # fmt: skip


def _without_client_headers(names: tuple[str, ...]) -> dict[str, Any]:
    """An HTTP filter, before the picker, that removes headers only the gateway may set."""
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _T + "extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": name.lower()} for name in names]},
        },
    }


def _stats_listener(host: str, port: int) -> dict[str, Any]:
    """GET /stats/prometheus and GET /ready, passed to the admin; any other path or method: 404."""
    routes = [{
        "match": {"path": path, "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
        "route": {"cluster": ADMIN_CLUSTER},
    } for path in STATS_PATHS]  # fmt: skip
    manager = _http_manager(
        STATS_STAT_PREFIX,
        {"name": "flotilla_stats", "virtual_hosts": [{"name": "stats", "domains": ["*"], "routes": routes}]},
        [ROUTER],
    )
    return {
        "name": "flotilla_stats",
        "address": _socket(host, port),
        "filter_chains": [{"filters": [manager]}],
    }
