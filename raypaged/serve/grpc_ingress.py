"""The raypaged.v1 service as registered on Ray Serve's gRPC proxy (its grpc_servicer_functions).

Serve keeps each method's request deserializer and routes the parsed message to a replica. The
generated registration function's deserializer raises on bytes that do not parse, which grpc
answers UNKNOWN; this one registers the same methods with frontend/malformed.py's deserializer,
so such a request reaches the replica as an Undecodable marker and the replica answers
INVALID_ARGUMENT — what `raypaged launch` answers to the same bytes.
"""

from __future__ import annotations

from typing import Any

import grpc

from raypaged.frontend.malformed import safe_deserializer
from raypaged.proto.v1 import raypaged_pb2_grpc


class _Recorder:
    """Stands in for the server while the generated function lists its handlers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers also come by name, below

    def add_registered_method_handlers(self, service_name: str,
                                       method_handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.services[service_name] = method_handlers


def add_RaypagedServiceServicer_to_server(servicer: Any, server: Any) -> None:  # grpc's name for it
    """The generated function's registration, each request deserializer made safe."""
    recorder = _Recorder()
    raypaged_pb2_grpc.add_RaypagedServiceServicer_to_server(servicer, recorder)
    for service_name, method_handlers in recorder.services.items():
        guarded = {
            name: handler._replace(request_deserializer=safe_deserializer(
                handler.request_deserializer, f"/{service_name}/{name}"))
            for name, handler in method_handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, guarded),))
        if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.63
            server.add_registered_method_handlers(service_name, guarded)
