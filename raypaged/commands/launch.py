"""`raypaged launch`: start (or join) Ray, create the engine actor and its TP workers, serve gRPC
and Prometheus metrics, and shut everything down on SIGINT / SIGTERM. `raypaged serve`
(commands/serve.py) is the same with the OpenAI HTTP API attached."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from raypaged.commands.network_security import add_security_args, security_from_args
from raypaged.config import SERVING_MAX_WAITING_REQUESTS, EngineConfig
from raypaged.frontend.prefix_router import ROUTING_POLICIES

if TYPE_CHECKING:
    from raypaged.frontend.server import FrontendServer

# Another front door over a started FrontendServer: its ready-line words and how to stop it.
Attach = Callable[["FrontendServer"], Awaitable[tuple[str, Callable[[], Awaitable[Any]]]]]


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("launch", help="serve a model over gRPC (the built-in demo model by default)",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    group = add_server_args(parser)
    group.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(run=run, max_waiting_requests=SERVING_MAX_WAITING_REQUESTS)


def add_server_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The options launch and serve share (all but the ports); returns the "server" group."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (0.0.0.0: every interface; mind who can reach it)")
    group.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics on this port (0: any free port; default: off)")
    group.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                       help="the model's name(s): the first in ModelInfo, metric labels and "
                            "responses; /v1/models lists them all and requests may use any "
                            "(default: the directory's name)")
    group.add_argument("--shutdown-grace", type=float, default=30.0,
                       help="seconds that streams in flight get to finish on SIGINT / SIGTERM")
    group.add_argument("--engine-restart", action=argparse.BooleanOptionalAction, default=True,
                       help="start a new engine (with backoff) when the engine actor dies")
    group.add_argument("--engine-recovery-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="how long streams in flight (and new requests) wait for the new engine "
                            "after the engine actor died, to go on there with nothing lost; past "
                            "it they end with UNAVAILABLE (0: at once)")
    group.add_argument("--data-parallel-size", "--dp", type=int, default=1,
                       help="engine replicas behind this frontend, each with its own TP group and "
                            "KV pool; a router picks one per request")
    group.add_argument("--routing-policy", choices=ROUTING_POLICIES, default="prefix",
                       help="with --data-parallel-size > 1: prefix (the longest cached prefix, "
                            "weighed against load), p2c (power of two choices), round_robin")
    add_security_args(parser)
    return group


def run(args: argparse.Namespace) -> int:
    return run_server(args, "launch")


def run_server(args: argparse.Namespace, command: str, attach: Attach | None = None,
               ports: tuple[int | None, ...] = ()) -> int:
    """Check the settings, then serve until a signal: 0 after a clean stop, 2 for a setting
    that does not fit, 1 when a port cannot be bound. ports: more ports to check up front."""
    import asyncio
    import logging

    from raypaged.config import ConfigError
    from raypaged.frontend.supervisor import RestartPolicy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig.from_cli_args(args)
        config.validate()
        _check_data_parallel(args, config)
        args.security = security_from_args(args)
        args.restart_policy = RestartPolicy(recovery_timeout_s=args.engine_recovery_timeout)
    except (ConfigError, ValueError) as e:  # ValueError: a bad TLS, token or recovery setting
        print(f"raypaged {command}: {e}", file=sys.stderr)
        return 2
    try:
        for port in (args.port, args.metrics_port, *ports):
            _check_port_free(args.host, port)  # before minutes of start-up, not after
        return asyncio.run(serve(config, args, attach))
    except ConfigError as e:  # one the model rules out (e.g. tp not dividing its heads)
        print(f"raypaged {command}: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the port is taken
        print(f"raypaged {command}: {e}", file=sys.stderr)
        return 1


def _check_data_parallel(args: argparse.Namespace, config: EngineConfig) -> None:
    from raypaged.config import ConfigError

    if args.data_parallel_size < 1:
        raise ConfigError("--data-parallel-size must be >= 1")
    if args.data_parallel_size > 1 and config.scheduler.enable_prefix_caching \
            and config.scheduler.prefix_caching_hash_algo != "sha256":
        raise ConfigError("--data-parallel-size > 1 routes by block hashes, which must mean the same "
                          "in every process: --prefix-caching-hash-algo sha256")


def _gpu_share(config: EngineConfig, replicas: int) -> float:
    """The part of a GPU each data-parallel engine reserves: a whole one while the cluster has
    one for each; else they share the cards (tp 1 only), each within its memory share."""
    import ray

    from raypaged.config import ConfigError

    gpus: float = ray.cluster_resources().get("GPU", 0)
    if not gpus or gpus >= replicas * config.parallel.tensor_parallel_size:
        return 1.0
    if config.parallel.tensor_parallel_size > 1:
        raise ConfigError(f"{replicas} replicas of tp {config.parallel.tensor_parallel_size} need "
                          f"{replicas * config.parallel.tensor_parallel_size} GPUs, the cluster has {gpus:g}")
    share = gpus / replicas
    if config.cache.gpu_memory_utilization > share:
        raise ConfigError(f"{replicas} engines share {gpus:g} GPU(s): --gpu-memory-utilization must be "
                          f"at most {share:g} (each engine's share of the memory)")
    return share


def _check_port_free(host: str, port: int | None) -> None:
    import socket

    if not port:
        return
    try:
        socket.create_server((host, port)).close()
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


async def serve(config: EngineConfig, args: argparse.Namespace, attach: Attach | None = None) -> int:
    """attach: another front door over the same server's GenerationService, started once the
    gRPC server is (its description ends the ready line) and stopped with it."""
    import asyncio
    import logging
    import os
    import signal

    import ray
    from transformers import AutoTokenizer

    from raypaged.commands.network_security import warn_if_exposed
    from raypaged.engine.client import AsyncEngineClient
    from raypaged.frontend.data_parallel import DataParallelEngineClient, EngineHandle
    from raypaged.frontend.load_shedding import OverloadPolicy
    from raypaged.frontend.router_metrics import RouterMetrics
    from raypaged.frontend.server import FrontendServer, ServerConfig
    from raypaged.frontend.tenants import unused_priorities_warning

    logger = logging.getLogger("raypaged.launch")
    security = args.security
    warn_if_exposed(args.host, security, logger)
    unused = unused_priorities_warning(security.api_keys, config.scheduler.scheduling_policy)
    if unused is not None:
        logger.warning("%s", unused)
    started_ray = not ray.is_initialized()
    if started_ray:
        # Ray's GCS keeps the events of up to 100,000 tasks (~200 MiB); the engine makes one
        # task per step, so a busy server reaches that in minutes. 10,000 bounds it at a tenth.
        os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", "10000")
        ray.init(address=ray_init_address(config.parallel.ray_address), include_dashboard=False,
                 log_to_driver=True)
    engine: EngineHandle | None = None
    try:
        if args.data_parallel_size > 1:
            share = _gpu_share(config, args.data_parallel_size)
            engine = await DataParallelEngineClient.start(
                args.data_parallel_size, lambda: AsyncEngineClient.start(config, gpu_share=share),
                args.routing_policy, restart=args.engine_restart)
        else:
            engine = await AsyncEngineClient.start(config)
        info = engine.model_info
        tokenizer = AutoTokenizer.from_pretrained(config.model_settings.tokenizer or info["model_dir"])
        names = args.served_model_name
        model_name = names[0] if names else ("demo" if config.model_settings.model is None else None)
        server = FrontendServer(
            engine, tokenizer,
            ServerConfig(host=args.host, port=args.port, metrics_port=args.metrics_port,
                         model_name=model_name, shutdown_grace_s=args.shutdown_grace,
                         max_message_bytes=security.max_message_bytes, tls=security.tls,
                         auth_token=security.auth_token, tenants=security.api_keys,
                         overload=OverloadPolicy.from_config(config), restart_policy=args.restart_policy),
            owns_engine=True,
            engine_factory=((lambda: AsyncEngineClient.start(config))
                            if args.engine_restart and args.data_parallel_size == 1 else None))
        if isinstance(engine, DataParallelEngineClient):
            engine.attach_metrics(RouterMetrics(server.metrics.registry, server.service.model_name))
        await server.start()
        described, stop_attached = "", None
        if attach is not None:
            try:
                described, stop_attached = await attach(server)
            except BaseException:
                await server.shutdown(grace_s=0)
                engine = None  # the server shut it down
                raise
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _on_signal, server, sig, logger, stop_attached)
        metrics = (f", metrics on http://{args.host}:{server.metrics_port}/metrics"
                   if server.metrics_port else "") + described
        # One line that scripts wait for: the address is real and the server is SERVING.
        logger.info("raypaged ready: serving %s (%s, %d KV blocks of %d tokens, tp %d, dp %d)%s on %s%s",
                    server.service.model_name, info["architecture"], info["num_blocks"],
                    info["block_size"], info["tensor_parallel_size"], args.data_parallel_size,
                    " over TLS" if security.tls else "", server.address, metrics)
        engine = None  # the server owns it now
        await server.wait_closed()
        if stop_attached is not None:
            await stop_attached()
        logger.info("raypaged stopped")
        return 0
    finally:
        if engine is not None:
            await engine.shutdown()
        if started_ray:
            ray.shutdown()


def ray_init_address(setting: str | None) -> str | None:
    """What `ray.init(address=...)` gets for the --ray-address setting: "auto" or HOST:PORT join
    that cluster; unset, the cluster RAY_ADDRESS names (a KubeRay pod's) or else a local Ray of
    this server's own ("local"). Never a bare None without RAY_ADDRESS: Ray's None joins whatever
    cluster `ray start` last started on this host (its /tmp/ray/ray_current_cluster), someone
    else's included, and the server then lives and dies with it."""
    import os

    if setting:
        return setting
    return None if os.environ.get("RAY_ADDRESS") else "local"


def _on_signal(server, sig, logger, stop_attached) -> None:
    import asyncio

    if server.service.accepting:
        logger.info("%s: shutting down (streams in flight get %.0f s to finish; again to cut that short)",
                    sig.name, server.config.shutdown_grace_s)
        loop = asyncio.get_running_loop()
        loop.create_task(server.shutdown())
        if stop_attached is not None:  # it stops taking connections; its streams drain alike
            loop.create_task(stop_attached())
    else:
        logger.info("%s again: cancelling the streams in flight", sig.name)
        server.service.stop_waiting()
