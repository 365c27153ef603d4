"""The Ray tensor-parallel executor: one worker actor per GPU (or CPU share), one placement group.

Every rank gets the same SchedulerOutput each step (same block ids: each rank holds its own KV
heads for them) and rank 0 returns the sampled tokens. The per-step broadcast goes through a Ray
Compiled Graph: a plain actor call costs ~1 ms, a compiled-graph round trip a tenth of that.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray

from raypaged.config import EngineConfig
from raypaged.core.outputs import KVCopyTimes, ModelRunnerOutput, SchedulerOutput
from raypaged.executor.base import Executor, WorkerCall, call_on_worker
from raypaged.executor.errors import WorkerGroupError
from raypaged.executor.placement import WorkerPlacement, place_workers

if TYPE_CHECKING:
    from ray.dag.compiled_dag_node import CompiledDAG

    from raypaged.worker.worker import Worker

logger = logging.getLogger(__name__)

# What a broken worker group looks like from the driver: an actor died, a channel broke or timed
# out, or a worker raised.
_GROUP_FAILURES: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,
    ray.exceptions.RayChannelError,
    ray.exceptions.GetTimeoutError,
    ray.exceptions.RayTaskError,
    ray.exceptions.RaySystemError,
    TimeoutError,
)


class RayWorkerActor:
    """Hosts one Worker in its own process (ray.remote is applied when the executor creates it)."""

    def __init__(self, config: EngineConfig, model_dir: str, rank: int, world_size: int) -> None:
        self.args = (config, model_dir, rank, world_size)
        self.worker: Worker | None = None

    def address_for_rendezvous(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port  # type: ignore[no-untyped-call]  # unannotated in Ray

    def init_worker(self, init_method: str) -> None:
        from raypaged.worker.worker import Worker

        config, model_dir, rank, world_size = self.args
        self.worker = worker = Worker(config, model_dir, rank=rank, world_size=world_size,
                                      distributed_init_method=init_method, local_rank=0)
        worker.init_device()
        worker.load_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        assert self.worker is not None  # init_worker ran
        return self.worker.execute_model(scheduler_output)

    def pid(self) -> int:
        import os

        return os.getpid()

    def collective_rpc(self, method: WorkerCall, args: Sequence[Any]) -> Any:
        """This rank's part of RayExecutor.collective_rpc."""
        return call_on_worker(self.worker, method, args)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.config = config
        self.model_dir = model_dir
        self.world_size = config.parallel.tensor_parallel_size
        if not ray.is_initialized():
            ray.init(address=config.parallel.ray_address, include_dashboard=False,
                     log_to_driver=False, ignore_reinit_error=True)
        self.use_gpu = self._use_gpu()
        self.workers: list[Any] = []
        self.placement: WorkerPlacement | None = None
        self.compiled_dag: CompiledDAG | None = None
        self._failed = False  # set once a call to the group failed: shutdown then kills first
        try:
            self._start_workers()
        except BaseException:
            # A group that cannot start (a rank fails to load, no resources) must not keep its
            # actors and placement group: the engine's next restart attempt needs them.
            self._failed = True
            self.shutdown()
            raise

    def _use_gpu(self) -> bool:
        if self.config.model_settings.device == "cpu":
            return False
        gpus: float = ray.cluster_resources().get("GPU", 0)  # type: ignore[no-untyped-call]  # unannotated in Ray
        if self.config.model_settings.device == "cuda" and gpus < self.world_size:
            raise RuntimeError(f"tensor_parallel_size {self.world_size} needs {self.world_size} GPUs; "
                               f"the Ray cluster has {gpus:g}")
        return gpus >= self.world_size

    def _start_workers(self) -> None:
        """Place the group (waiting for capacity, bounded), start one actor per rank, join them
        in one process group and load the model. Each wait is bounded: placement_timeout_s for
        the placement, ray_start_timeout_s for the rest."""
        cpus = self.config.parallel.cpus_per_worker(self.use_gpu)
        bundle = {"CPU": cpus, "GPU": 1} if self.use_gpu else {"CPU": cpus}
        self.placement = placement = place_workers(self.world_size, bundle,
                                                   self.config.parallel.placement_timeout_s)
        actor_class = ray.remote(RayWorkerActor)
        config = self.config
        if not self.use_gpu and config.model_settings.device == "auto":
            # The workers must agree with the placement: no GPU was reserved for them.
            config = config.replace(device="cpu")
        self.workers = [
            actor_class.options(num_cpus=cpus, num_gpus=1 if self.use_gpu else 0,
                                scheduling_strategy=placement.strategy(rank),
                                ).remote(config, self.model_dir, rank, self.world_size)
            for rank in range(self.world_size)
        ]
        [(host, port)] = self._wait_all([self.workers[0].address_for_rendezvous.remote()],
                                        "address_for_rendezvous")
        # All ranks join torch.distributed together: each call blocks until every rank arrives.
        init_method = f"tcp://{host}:{port}"
        self._wait_all([w.init_worker.remote(init_method) for w in self.workers], "init_worker")
        self.compiled_dag = self._compile() if self.config.parallel.use_compiled_graph else None

    def _compile(self) -> CompiledDAG:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as scheduler_output:
            dag = MultiOutputNode([w.execute_model.bind(scheduler_output) for w in self.workers])
        compiled: CompiledDAG = dag.experimental_compile()
        return compiled

    def _wait_all(self, refs: list[Any], what: str, timeout_s: float | None = None) -> list[Any]:
        """The refs' results, within timeout_s (default ray_start_timeout_s); a failure or a
        timeout marks the group failed and raises WorkerGroupError."""
        try:
            return ray.get(refs, timeout=timeout_s or self.config.parallel.ray_start_timeout_s)
        except _GROUP_FAILURES as e:
            self._failed = True
            raise WorkerGroupError(f"worker group failed in {what}: {e}") from e

    # ---- the executor interface --------------------------------------------------------------
    def determine_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        per_rank: list[int] = self.collective_rpc("determine_num_blocks", (max_model_len, max_num_batched_tokens))
        return min(per_rank)

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks, max_model_len))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        results: list[ModelRunnerOutput]
        try:
            if self.compiled_dag is not None:
                refs = self.compiled_dag.execute(scheduler_output)
                results = ray.get(refs, timeout=self.config.parallel.step_timeout_s)
            else:
                results = ray.get([w.execute_model.remote(scheduler_output) for w in self.workers],
                                  timeout=self.config.parallel.step_timeout_s)
        except _GROUP_FAILURES as e:
            self._failed = True
            raise WorkerGroupError(f"a tensor-parallel worker failed: {e}") from e
        output = results[0]
        if output.kv_copy_times is not None and len(results) > 1:
            output.kv_copy_times = KVCopyTimes.slowest(
                [r.kv_copy_times for r in results if r is not None and r.kv_copy_times is not None])
        return output

    @staticmethod
    def _wait_until_dead(actors: list[Any], timeout_s: float = 30.0) -> None:
        """ray.kill returns at once; a new group must not be wired up (compiled-graph channels
        registered) while the old actors are still going down."""
        for actor in actors:
            try:
                ray.get(actor.pid.remote(), timeout=timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass

    def collective_rpc(self, method: WorkerCall, args: Sequence[Any] = ()) -> list[Any]:
        refs = [w.collective_rpc.remote(method, tuple(args)) for w in self.workers]
        return self._wait_all(refs, method if isinstance(method, str) else repr(method))

    def check_health(self) -> None:
        # A plain call on each actor (beside the compiled graph's loop): a dead actor fails it at
        # once, a stopped or wedged one is hung by the step's own bound.
        self._wait_all([w.pid.remote() for w in self.workers], "health check",
                       self.config.parallel.step_timeout_s)

    def worker_pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in self.workers])

    def shutdown(self) -> None:
        if self._failed:
            # A rank whose peer raised or died can be blocked in a collective the peer never
            # joins; the compiled graph's teardown would wait on it forever. Kill first.
            for worker in self.workers:
                ray.kill(worker, no_restart=True)
            self._wait_until_dead(self.workers)
        if self.compiled_dag is not None:
            try:
                self.compiled_dag.teardown()
            except Exception:  # a broken group cannot always be torn down cleanly: kill below
                logger.debug("compiled graph teardown failed", exc_info=True)
            # Teardown leaves the graph's driver-side proxy actor to die with its owner (this
            # process), which outlives the executor when the engine restarts its workers.
            proxy = getattr(self.compiled_dag, "_proxy_actor", None)
            if proxy is not None:
                ray.kill(proxy, no_restart=True)
            self.compiled_dag = None
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self._wait_until_dead(self.workers)
        self.workers = []
        if self.placement is not None:
            self.placement.release()
        self.placement = None
