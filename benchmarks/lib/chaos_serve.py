"""The Serve app as a chaos soak's target (`ServeTarget`): an ingress (OpenAI HTTP through
Serve's HTTP proxy, raypaged.v1 through its gRPC proxy) over at least two engine replicas, the
app of `raypaged.serve:build_app`, so that a replica killed mid-stream has another to go on on.

The app runs in a child process in a session of its own (`python -m benchmarks.lib.chaos_serve
ARGS_JSON`: Ray of its own, Serve's proxies on free ports, the app; it logs the same ready line
as `raypaged serve`, and SIGTERM deletes the app gracefully — streams in flight finish — then shuts Serve and Ray down,
and exits 0), so its
processes are measured and signalled as a `raypaged serve`'s are. The soak's process joins that
Ray as a driver to read the replicas (their engines' pools, the ingress's streams) and to kill
a replica's actor (`kill_replica`, the `replica_killed` fault of chaos_replica.py).
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, cast

from benchmarks.lib.chaos_target import ChaosTarget, PoolReport
from benchmarks.lib.launched_server import LaunchedServer

if TYPE_CHECKING:
    from raypaged.proto.v1 import raypaged_pb2 as pb

APP = "raypaged"
ENGINE = "raypaged_engine"  # build_app's engine deployment beside the ingress APP
# A fraction of a CPU per replica: an ingress and two engine replicas fit in 2 cores. The pool
# bounds a resumed stream's wait for a replica; Serve brings a killed one back in ~10-20 s here.
# Each engine runs its worker as a Ray actor even at TP 1 (the worker faults' victims), with
# the gRPC-server target's step timeout (a hung worker found in seconds) and restarts.
DEFAULT_APP_ARGS: dict[str, Any] = {"model": None, "num_replicas": 2, "replica_num_cpus": 0.1,
                                    "ingress_num_cpus": 0.1, "device": "cpu", "replica_recovery_timeout_s": 120.0,
                                    "distributed_executor_backend": "ray", "ray_cpus_per_worker": 0.1,
                                    "step_timeout_s": 5.0, "max_worker_restarts": 3}
POOL_KEYS = ("num_blocks", "num_free_blocks", "num_running", "num_waiting")


class ServeProcess(LaunchedServer):
    """This module run as a child in a session of its own; ready once it logs its ready line."""

    def __init__(self, app_args: dict[str, Any], num_cpus: int = 2) -> None:
        # Not LaunchedServer.__init__: another command line, the same log reading.
        self._spawn([sys.executable, "-m", "benchmarks.lib.chaos_serve", json.dumps(app_args), str(num_cpus)])


class ServeTarget(ChaosTarget):
    """The Serve app of `app_args` (build_app's arguments over DEFAULT_APP_ARGS; at least two
    engine replicas). Takes `replica_killed`, `engine_sigkill` (an engine actor's process: its
    replica's streams go on on another, Serve replaces the replica as its health check fails)
    and the worker faults `worker_sigkill` / `worker_hang` (a replica's `ray::RayWorkerActor`:
    its engine restarts its worker group, inside the replica's placement group, and its
    streams go on there)."""

    fault_kinds = frozenset({"replica_killed", "engine_sigkill", "worker_sigkill", "worker_hang"})

    def __init__(self, app_args: dict[str, Any] | None = None, num_cpus: int = 2) -> None:
        self.app_args = {**DEFAULT_APP_ARGS, **(app_args or {})}
        self.num_replicas = int(self.app_args["num_replicas"])
        if self.num_replicas < 2:
            raise ValueError("a Serve chaos target needs at least 2 engine replicas (one to go on on)")
        self.process = ServeProcess(self.app_args, num_cpus)
        self._connected = False

    # ---- the app, through a driver of its Ray ---------------------------------------------------
    def start(self, timeout_s: float = 300.0) -> pb.ModelInfo:
        import ray
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        from raypaged.client import Client

        self.process.wait_ready(timeout_s)
        self.address, self.http_url = self.process.address, self.process.http_url
        # The app's Ray (ray.init of its own) has token authentication on, with this user's
        # token; a driver joining it must present it (Ray does not turn it on for a join).
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        ray.init(address=self.process.gcs_address(), include_dashboard=False, log_to_driver=False)
        self._connected = True
        deadline = time.monotonic() + timeout_s
        while len(self.engine_replicas()) < self.num_replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {self.num_replicas} engine replicas came up")
            time.sleep(0.2)
        assert self.address is not None
        with Client(self.address) as client:
            return client.model_info()

    def engine_replicas(self) -> list[str]:
        """The unique ids of the engine replicas whose actors live now."""
        import ray

        prefix = f"SERVE_REPLICA::{APP}#{ENGINE}#"
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        return sorted(n[len(prefix):] for n in names if n.startswith(prefix))

    def engine_stats(self, replica: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """That replica's serve/engine_deployment.py engine_stats (a call pinned to it)."""
        from ray import serve

        from raypaged.serve.route_hint import RouteHint

        handle = serve.get_deployment_handle(ENGINE, APP)
        return handle.engine_stats.remote(route=RouteHint(pin=replica)).result(timeout_s=timeout_s)

    def ingress_stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Streams in flight at the ingress, and how many went on on another replica so far."""
        from ray import serve

        return serve.get_app_handle(APP).ingress_stats.remote().result(timeout_s=timeout_s)

    def kill_replica(self, rng_value: float, busy_wait_s: float = 10.0) -> tuple[str, int, int]:
        """ray.kill one engine replica's actor: among those streaming now (mid-stream; waited
        for up to busy_wait_s), else any, picked by `rng_value`. (the replica, its requests
        running, replicas alive)."""
        import ray

        deadline = time.monotonic() + busy_wait_s
        while True:
            replicas = self.engine_replicas()
            if not replicas:
                raise RuntimeError("no engine replica to kill")
            running = {r: _running(self, r) for r in replicas}
            busy = [r for r in replicas if running[r] > 0]
            if busy or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        busy = busy or replicas
        victim = busy[int(rng_value * len(busy))]
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#{ENGINE}#{victim}", namespace="serve"), no_restart=True)
        return victim, running[victim], len(replicas)

    # ---- ChaosTarget ---------------------------------------------------------------------------
    def serving(self) -> bool:
        """As many engine replicas as asked, each one serving a two-token request pinned to it
        (its engine steps its workers: a replica whose worker died is not serving until its
        engine has restarted them), and a two-token request through the ingress's gRPC."""
        from raypaged.client import Client

        try:
            replicas = self.engine_replicas()
            if len(replicas) < self.num_replicas:
                return False
            if not all(self.generate_pinned(replica, 2, timeout_s=5.0) == 2 for replica in replicas):
                return False
            assert self.address is not None
            with Client(self.address) as client:
                result = client.generate([3, 4, 5], max_tokens=2, temperature=0.0, ignore_eos=True, timeout=5.0)
            return len(result.outputs[0].token_ids) == 2
        except Exception:  # noqa: BLE001 - a replica starting or gone, a probe refused: not yet
            return False

    def generate_pinned(self, replica: str, max_tokens: int, timeout_s: float) -> int:
        """The tokens a greedy request of max_tokens, sent to that engine replica alone (past
        the ingress), streamed back."""
        import uuid

        from ray import serve
        from ray.serve.handle import DeploymentResponseGenerator

        from raypaged.core.outputs import EngineCoreOutput
        from raypaged.core.request import Request
        from raypaged.core.sampling_params import SamplingParams
        from raypaged.serve.route_hint import RouteHint

        request = Request(f"probe-{uuid.uuid4().hex}", [3, 4, 5],
                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        handle = serve.get_deployment_handle(ENGINE, APP).options(stream=True)
        stream = cast(DeploymentResponseGenerator,
                      handle.generate.remote(request, timeout_s, route=RouteHint(pin=replica)))
        tokens = [0]

        def drain() -> None:
            try:
                tokens[0] = sum(len(item.new_token_ids) for item in stream if isinstance(item, EngineCoreOutput))
            except Exception:  # noqa: BLE001 - cancelled below, or the replica failed it: no tokens
                pass

        # A call pinned to a replica that is gone waits for it to come back (the router backs
        # off and asks again), and a stream's iteration takes no timeout: bound it here.
        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if reader.is_alive():
            stream.cancel()
            return 0
        return tokens[0]

    def settle(self, timeout_s: float = 15.0) -> PoolReport:
        """Whole: the ingress holds no stream and every engine replica is idle with its pool whole."""
        deadline = time.monotonic() + timeout_s
        while True:
            report = self._pools()
            if report.whole or time.monotonic() > deadline:
                return report
            time.sleep(0.25)

    def _pools(self) -> PoolReport:
        try:
            ingress = self.ingress_stats()
            stats = [self.engine_stats(r) for r in self.engine_replicas()]
        except Exception:  # noqa: BLE001 - a replica replaced meanwhile: not settled yet
            return PoolReport(False, dict.fromkeys(POOL_KEYS), None)
        pool: dict[str, float | None] = {k: float(sum(s[k] for s in stats)) for k in POOL_KEYS}
        whole = (len(stats) >= self.num_replicas and ingress["in_flight"] == 0
                 and all(s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_blocks"]
                         for s in stats))
        return PoolReport(whole, {**pool, "replicas": float(len(stats)), "ingress_in_flight": ingress["in_flight"]},
                          ingress["resumed"])

    def gcs_address(self) -> str | None:
        return self.process.gcs_address()

    def session_pids(self) -> list[int]:
        return self.process.session_pids()

    def pids_named(self, prefix: str) -> list[int]:
        return self.process.pids_named(prefix)

    def rss_by_process(self) -> dict[int, tuple[str, int]]:
        return self.process.rss_by_process()

    def stop(self, timeout_s: float = 120.0) -> int:
        self._disconnect()
        return self.process.stop(timeout_s)

    def kill(self) -> None:
        self._disconnect()
        self.process.kill()

    def _disconnect(self) -> None:
        if self._connected:
            import ray

            ray.shutdown()
            self._connected = False


def _running(target: ServeTarget, replica: str) -> int:
    try:
        return int(target.engine_stats(replica)["num_running"])
    except Exception:  # noqa: BLE001 - gone meanwhile: nothing of it to catch mid-stream
        return 0


# ---- the child process ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str]) -> int:
    """Ray (num_cpus), Serve's proxies and the app of the JSON arguments; the ready line; on
    SIGTERM the app deleted gracefully (streams in flight finish), then Serve and Ray; exit 0."""
    import ray
    from ray import serve

    from raypaged.serve import GRPC_SERVICER_FUNCTION, build_app

    app_args, num_cpus = json.loads(argv[0]), int(argv[1])
    http, grpc_port, metrics = _free_port(), _free_port(), _free_port()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=metrics)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # after ray.init, which sets its own (exit 15)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http},
                    grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER_FUNCTION]})
        serve.run(build_app(app_args), name=APP, route_prefix="/")
        print(f"raypaged ready: Serve app {APP} on 127.0.0.1:{grpc_port}, metrics on "
              f"http://127.0.0.1:{metrics}/metrics, OpenAI API on http://127.0.0.1:{http}/v1", flush=True)
        while not stop.wait(0.5):
            pass
        # The app first, alone: Serve stops its replicas gracefully (each finishes the requests
        # it holds, within graceful_shutdown_timeout_s) while the proxies still carry their
        # streams; serve.shutdown() at once would take the proxies down under them.
        serve.delete(APP)
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
