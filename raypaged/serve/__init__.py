"""raypaged on Ray Serve: `raypaged.serve:build_app` (a Serve config's import_path) serves OpenAI-
compatible HTTP and raypaged.v1 gRPC from an ingress deployment, over engine deployment replicas
(one engine each) it calls through DeploymentHandles. Needs `raypaged[serve]`."""

from raypaged.serve.app import GRPC_SERVICER_FUNCTION, build_app, deployment_options, ingress_options
from raypaged.serve.args import AutoscalingArgs, ServeAppArgs
from raypaged.serve.deployment import IngressDeployment
from raypaged.serve.engine_deployment import EngineDeployment

__all__ = ["GRPC_SERVICER_FUNCTION", "AutoscalingArgs", "EngineDeployment", "IngressDeployment", "ServeAppArgs",
           "build_app", "deployment_options", "ingress_options"]
