"""What the Serve app's live tests share: free ports, one module's Ray + Serve instance, and a
view of the engine deployment's replicas (each read through a pinned handle call)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import ray
from ray import serve

from raypaged.serve import GRPC_SERVICER_FUNCTION, build_app
from raypaged.serve.route_hint import RouteHint

APP = "raypaged"
ENGINE = "raypaged_engine"  # build_app's engine deployment, beside the ingress "raypaged"
# Small pools, a fraction of a CPU per actor: two engines and an ingress fit in num_cpus=2.
PROMPTS = ["The block table maps", "def attention(query, key", "Pack my box with"]
MAX_TOKENS = 12
ENGINE_ARGS = {"num_gpu_blocks_override": 64, "max_num_seqs": 8, "replica_num_cpus": 0.1,
               "ingress_num_cpus": 0.1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_instance(app_args: dict[str, Any], metrics: bool = False) -> Iterator[dict[str, Any]]:
    """Ray (2 CPUs), Serve's HTTP and gRPC proxies on free ports, and build_app(app_args) as APP."""
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    extra: dict[str, Any] = {}
    if metrics:  # Ray exports the replicas' metrics on its node metrics port; report often.
        extra = {"_metrics_export_port": ports["metrics"], "_system_config": {"metrics_report_interval_ms": 500}}
    # address="local": a fresh instance of our own, never another test run's cluster on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, **extra)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": ports["http"]},
                    grpc_options={"port": ports["grpc"], "grpc_servicer_functions": [GRPC_SERVICER_FUNCTION]})
        serve.run(build_app(app_args), name=APP, route_prefix="/")
        yield {**ports, "base": f"http://127.0.0.1:{ports['http']}"}
    finally:
        serve.shutdown()
        ray.shutdown()


def engine_replicas(app: str = APP) -> list[str]:
    """The unique ids of the engine deployment's replica actors alive now."""
    prefix = f"SERVE_REPLICA::{app}#{ENGINE}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(n[len(prefix):] for n in names if n.startswith(prefix))


def engine_handle(app: str = APP) -> Any:
    return serve.get_deployment_handle(ENGINE, app)


def engine_stats(replica: str, app: str = APP) -> dict[str, Any]:
    """serve/engine_deployment.py engine_stats of that replica."""
    return engine_handle(app).engine_stats.remote(route=RouteHint(pin=replica)).result(timeout_s=30)


def idle_and_whole(report: dict[str, Any]) -> bool:
    return (report["num_running"] == 0 and report["num_waiting"] == 0
            and report["num_free_blocks"] == report["num_blocks"])


def engines_satisfy(predicate: Callable[[dict[str, Any]], bool], num_replicas: int = 2,
                    timeout_s: float = 60.0, app: str = APP) -> dict[str, dict[str, Any]]:
    """Every engine replica's report, polled until there are num_replicas and each satisfies
    predicate (a replica Serve is still replacing answers once it is up)."""
    deadline = time.monotonic() + timeout_s
    reports: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        replicas = engine_replicas(app)
        if len(replicas) == num_replicas:
            with contextlib.suppress(Exception):
                reports = {r: engine_stats(r, app) for r in replicas}
                if all(predicate(r) for r in reports.values()):
                    return reports
        time.sleep(0.1)
    raise AssertionError(f"the engine replicas never all satisfied the condition: {reports}")


def ingress_stats(app: str = APP) -> dict[str, Any]:
    return serve.get_app_handle(app).ingress_stats.remote().result(timeout_s=30)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['base']}/v1", api_key="unused", max_retries=0, timeout=60)


SWITCH = {"type": "function", "function": {"name": "switch", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}}}


def named_call(api: openai.OpenAI):
    return api.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "Lights on?"}], max_tokens=40, temperature=0.0,
        tools=[SWITCH], tool_choice={"type": "function", "function": {"name": "switch"}})


def engines_idle() -> dict[str, dict[str, Any]]:
    """Both engine replicas idle with their pools whole, and the ingress streaming nothing."""
    deadline = time.monotonic() + 30
    while ingress_stats()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ingress_stats()["in_flight"] == 0
    return engines_satisfy(idle_and_whole)
