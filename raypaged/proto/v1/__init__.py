"""raypaged.v1: messages (raypaged_pb2) and service stubs (raypaged_pb2_grpc), generated from
protos/raypaged/v1/raypaged.proto by scripts/gen_protos.sh; never edit the generated files."""

from raypaged.proto.v1 import raypaged_pb2, raypaged_pb2_grpc

SERVICE_NAME: str = raypaged_pb2.DESCRIPTOR.services_by_name["RaypagedService"].full_name

__all__ = ["SERVICE_NAME", "raypaged_pb2", "raypaged_pb2_grpc"]
