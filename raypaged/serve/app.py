"""`build_app`: the Serve application, from a Serve config's `args:` block or a dict.

Two deployments: the ingress (serve/deployment.py: OpenAI HTTP, raypaged.v1 gRPC, the text
side, tenants), which Serve's proxies call, and the engines (serve/engine_deployment.py, one
engine per replica, each in its own placement group), which the ingress calls through a
DeploymentHandle routed by serve/prefix_request_router.py.

    # deploy/serve_demo.yaml
    applications:
      - name: raypaged
        import_path: raypaged.serve:build_app
        args: {model: null, num_replicas: 1}

or in Python: `serve.run(build_app({"model": "/models/llama", "tensor_parallel_size": 2}))`.
Serve's gRPC proxy also needs `grpc_options.grpc_servicer_functions: [GRPC_SERVICER_FUNCTION]`
(serve.start(grpc_options=…) or the config's grpc_options), which build_app cannot set itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from raypaged.demo import DEMO_MODEL_DIR
from raypaged.serve.args import ServeAppArgs
from raypaged.serve.deployment import IngressDeployment
from raypaged.serve.engine_deployment import EngineDeployment
from raypaged.serve.placement import replica_bundles, uses_gpu

# Not the generated one: this one answers INVALID_ARGUMENT to bytes that do not parse.
GRPC_SERVICER_FUNCTION = "raypaged.serve.grpc_ingress.add_RaypagedServiceServicer_to_server"


def engine_deployment_name(args: ServeAppArgs) -> str:
    return f"{args.deployment_name}_engine"


def deployment_options(args: ServeAppArgs, cluster_gpus: float) -> dict[str, Any]:
    """The engine deployment's options: replicas or autoscaling, one placement group per
    replica, and the prefix-aware request router the ingress's handle routes with."""
    use_gpu = uses_gpu(args.engine, cluster_gpus)
    options: dict[str, Any] = {
        "name": engine_deployment_name(args),
        "max_ongoing_requests": args.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": args.replica_num_cpus},
        "placement_group_bundles": replica_bundles(args.engine, args.replica_num_cpus, use_gpu),
        # One node per replica: TP ranks talk over NVLink / shared memory, not the network.
        "placement_group_strategy": "STRICT_PACK",
        # Streams in flight get this long to finish when a replica is stopped (scale-down, update).
        "graceful_shutdown_timeout_s": 30.0,
        # Serve replaces a replica after 3 failed checks in a row: a replica whose engine died
        # is gone ~6 s later, not ~30 (the ingress routes around it meanwhile); the check only
        # reads a flag, so checking often costs nothing.
        "health_check_period_s": 2.0,
    }
    if args.autoscaling is not None:
        options["autoscaling_config"] = args.autoscaling.to_serve()
    else:
        options["num_replicas"] = args.num_replicas
    # Always, one replica too: a retry avoids the replica it lost (serve/route_hint.py).
    options["request_router_config"] = request_router_config(args)
    return options


def ingress_options(args: ServeAppArgs) -> dict[str, Any]:
    """The ingress deployment's options: no placement group, no GPU; Serve's default router
    (the proxies route before reading the body; the ingress routes the engines by prefix)."""
    return {"name": args.deployment_name, "num_replicas": args.ingress_num_replicas,
            "max_ongoing_requests": args.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": args.ingress_num_cpus},
            # Streams in flight get this long to finish when a replica is stopped.
            "graceful_shutdown_timeout_s": 30.0}


def request_router_config(args: ServeAppArgs) -> RequestRouterConfig:
    """The engine deployment's router: serve/prefix_request_router.py, fed by each replica's
    routing stats once a second."""
    engine = args.engine
    settings: dict[str, Any] = {
        "request_router_class": "raypaged.serve.prefix_request_router:PrefixAwareRequestRouter",
        "request_router_kwargs": {"block_size": engine.scheduler.block_size, "policy": args.routing_policy,
                                  "tokenizer": engine.model_settings.tokenizer or engine.model_settings.model
                                  or str(DEMO_MODEL_DIR)},
        "request_routing_stats_period_s": 1.0}
    return RequestRouterConfig(**settings)


def _cluster_gpus() -> float:
    """The cluster's GPUs; before Ray is up (`serve run raypaged.serve:build_app` builds the app
    first, then connects), this machine's."""
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0)
    import torch

    return torch.cuda.device_count()


def build_app(raw_args: dict[str, Any] | None = None) -> Application:
    """Checks every argument here, where a mistake is a clear error at `serve run` / deploy
    time rather than a replica that keeps failing to start."""
    args = raw_args if isinstance(raw_args, ServeAppArgs) else ServeAppArgs.from_dict(raw_args)
    cluster_gpus = _cluster_gpus()
    use_gpu = uses_gpu(args.engine, cluster_gpus)
    # Pin the device the bundles were sized for: a replica must never reach for a GPU its
    # placement group did not reserve (or leave a reserved one idle).
    args = dataclasses.replace(args, engine=args.engine.replace(device="cuda" if use_gpu else "cpu"))
    engines = serve.deployment(EngineDeployment).options(  # type: ignore[attr-defined]  # as below
        **deployment_options(args, cluster_gpus))
    # serve.ingress() is typed as returning a bare Callable, which picks deployment()'s other overload.
    ingress = serve.deployment(IngressDeployment).options(**ingress_options(args))  # type: ignore[attr-defined]
    return ingress.bind(args, engines.bind(args))
