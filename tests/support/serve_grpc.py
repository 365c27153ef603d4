"""A raypaged.v1 stub through a live Serve app's gRPC proxy (the `server` fixture of
tests/serve/conftest.py: its "grpc" port)."""

from __future__ import annotations

import grpc

from raypaged.proto.v1 import raypaged_pb2_grpc as pb_grpc


def grpc_stub(server) -> tuple[pb_grpc.RaypagedServiceStub, grpc.Channel]:
    """The stub and its channel; close the channel (`with channel:`) when done."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server['grpc']}")
    return pb_grpc.RaypagedServiceStub(channel), channel
