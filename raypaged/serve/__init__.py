"""raypaged on Ray Serve: `raypaged.serve:build_app` (a Serve config's import_path) serves one
engine per replica over OpenAI-compatible HTTP and raypaged.v1 gRPC. Needs `raypaged[serve]`."""

from raypaged.serve.app import GRPC_SERVICER_FUNCTION, build_app, deployment_options
from raypaged.serve.args import AutoscalingArgs, ServeAppArgs
from raypaged.serve.deployment import RaypagedDeployment

__all__ = ["GRPC_SERVICER_FUNCTION", "AutoscalingArgs", "RaypagedDeployment", "ServeAppArgs",
           "build_app", "deployment_options"]
