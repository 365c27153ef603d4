"""Faults under a live gRPC server with a TP=2 engine (CPU, gloo), seen from real clients.

- A tensor-parallel worker killed with SIGKILL, `ray.kill`ed, raising inside its step, or hung
  in it (past step_timeout_s): the engine restarts the whole group and recomputes; every
  client's stream goes on with no gap and no repeated token (it equals transformers' greedy
  output), health stays SERVING, the pool ends whole.
- A worker SIGKILLed while the engine is idle: the engine's idle health check finds it and
  restarts the group before any request arrives; health stays SERVING.
- A worker group that cannot come back (every restart fails): the streams in flight end with
  UNAVAILABLE, health turns NOT_SERVING, new requests get UNAVAILABLE; then the supervisor
  replaces the engine and the server serves again.
- The engine actor killed, with replay off (recovery_timeout_s 0; tests/reliability/test_replay.py
  has it on): streams end with UNAVAILABLE at once (no hang), new requests too, and the
  supervisor brings a new engine; nothing of the old one (actors, placement group) is left.

The tests share one server and run in order; each leaves it SERVING with a whole pool.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import grpc
import pytest
import ray

from raypaged.client import Client, RequestError
from raypaged.config import EngineConfig
from raypaged.frontend.server import ServerConfig
from raypaged.frontend.supervisor import RestartPolicy
from tests.support.checkpoints import checkpoint_dir
from tests.support.frontend_harness import ServerThread, init_ray
from tests.support.hf_oracle import hf_greedy, random_prompts, vocab_of
from tests.support.ray_state import alive_actors, live_placement_groups

pytestmark = pytest.mark.integration

NAME = "llama"
MAX_TOKENS = 48
STEP_TIMEOUT_S = 10.0  # a step (milliseconds here) slower than this is a hung worker group
FAULTS_SURVIVED: Counter = Counter()  # reported at the end of the module


@pytest.fixture(scope="module")
def server():
    init_ray()
    running = ServerThread(
        EngineConfig(model=str(checkpoint_dir(NAME)), device="cpu", tensor_parallel_size=2,
                     block_size=8, num_gpu_blocks_override=64, max_num_seqs=4, max_worker_restarts=1,
                     step_timeout_s=STEP_TIMEOUT_S),
        ServerConfig(port=0, stats_interval_s=0.1, restart_policy=RestartPolicy(initial_backoff_s=0.5,
                                                                           recovery_timeout_s=0)),
        restart_engine=True)
    yield running
    running.stop()
    ray.shutdown()
    print(f"\nfaults injected and survived: {dict(FAULTS_SURVIVED)}")


class HealthWatch:
    """Health polled every 20 ms in a thread: every status seen, in order."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with Client(self.address) as client:
            while not self._stop.is_set():
                try:
                    status = client.health(timeout=5)
                except RequestError as e:
                    status = e.code.name
                if not self.seen or self.seen[-1] != status:
                    self.seen.append(status)
                self._stop.wait(0.02)

    def wait_for(self, status: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while status not in self.seen:
            assert time.monotonic() < deadline, f"health never {status}: {self.seen}"
            time.sleep(0.02)


class Stream:
    """One greedy streaming request in a thread, every chunk's token ids kept."""

    def __init__(self, address: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> None:
        self.chunks: list[list[int]] = []
        self.finish_reason: str | None = None
        self.error: RequestError | None = None
        self.ended_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(address, prompt, max_tokens), daemon=True)
        self._thread.start()

    def _run(self, address: str, prompt: list[int], max_tokens: int) -> None:
        try:
            with Client(address) as client:
                for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                    self.chunks.append(chunk.outputs[0].token_ids)
                    self.finish_reason = chunk.outputs[0].finish_reason or self.finish_reason
        except RequestError as e:
            self.error = e
        finally:
            self.ended_at = time.monotonic()

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk]

    def wait_tokens(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.tokens) < count:
            assert self.ended_at is None, f"the stream ended early: {self.error}"
            assert time.monotonic() < deadline
            time.sleep(0.005)

    def join(self, timeout_s: float = 120.0) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream hangs"


def engine_call(server: ServerThread, fn):
    """fn(engine_actor_instance) run inside the engine actor."""
    return ray.get(server.engine.actor.__ray_call__.remote(fn), timeout=60)


def num_worker_restarts(server: ServerThread) -> int:
    return engine_call(server, lambda actor: actor.core.num_worker_restarts)


def kill_rank_with_sigkill(server: ServerThread) -> None:
    pids = ray.get(server.engine.actor.worker_pids.remote())
    os.kill(pids[1], signal.SIGKILL)


def kill_rank_with_ray_kill(server: ServerThread) -> None:
    engine_call(server, lambda actor: ray.kill(actor.core.executor.workers[1], no_restart=True))


def raise_in_rank(server: ServerThread) -> None:
    """Rank 1's next step raises (rank 0 meanwhile blocks in a collective rank 1 never joins)."""
    def arm(actor) -> None:
        def failing(*args, **kwargs):
            raise RuntimeError("injected fault: the worker's step raised")
        actor.worker.execute_model = failing

    workers = engine_call(server, lambda actor: actor.core.executor.workers)
    ray.get(workers[1].__ray_call__.remote(arm), timeout=60)


def hang_in_rank(server: ServerThread) -> None:
    """Rank 1's next step never returns (a wedged device, a deadlock)."""
    def arm(actor) -> None:
        def hanging(*args, **kwargs):
            import time

            time.sleep(3600)
        actor.worker.execute_model = hanging

    workers = engine_call(server, lambda actor: actor.core.executor.workers)
    ray.get(workers[1].__ray_call__.remote(arm), timeout=60)


FAULTS = {"sigkill": kill_rank_with_sigkill, "ray_kill": kill_rank_with_ray_kill, "raise": raise_in_rank,
          "hang": hang_in_rank}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_worker_fault_streams_go_on_without_gap_or_repeat(server, fault):
    prompts = random_prompts([6, 21, 13], vocab_of(NAME), seed=31)
    expected = [hf_greedy(checkpoint_dir(NAME), tuple(p), MAX_TOKENS) for p in prompts]
    restarts_before = num_worker_restarts(server)
    old_pids = ray.get(server.engine.actor.worker_pids.remote())
    with HealthWatch(server.address) as health:
        streams = [Stream(server.address, p) for p in prompts]
        for stream in streams:
            stream.wait_tokens(3)
        FAULTS[fault](server)
        for stream in streams:
            stream.join()
    for stream, want in zip(streams, expected):
        assert stream.error is None, stream.error
        assert stream.tokens == want  # no token lost, none repeated, none changed
        assert stream.finish_reason == "length"
    assert num_worker_restarts(server) == restarts_before + 1
    assert set(ray.get(server.engine.actor.worker_pids.remote())).isdisjoint(old_pids)
    assert health.seen == ["SERVING"]
    server.wait_pool_whole()
    assert len(live_placement_groups()) == 1
    FAULTS_SURVIVED[f"worker {fault}"] += 1


def test_idle_engine_replaces_a_worker_that_died_between_requests(server):
    server.wait_pool_whole()
    restarts_before = num_worker_restarts(server)
    old_pids = ray.get(server.engine.actor.worker_pids.remote())
    with HealthWatch(server.address) as health:
        kill_rank_with_sigkill(server)
        # No request comes: only the idle check (every 2 s by default) can find the dead rank.
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the idle engine never replaced its dead worker"
            if num_worker_restarts(server) > restarts_before:
                pids = engine_call(server, lambda actor: actor.core.executor.worker_pids()
                                   if actor.core.executor.workers else [])
                if len(pids) == 2 and set(pids).isdisjoint(old_pids):
                    break
            time.sleep(0.2)
    assert num_worker_restarts(server) == restarts_before + 1
    assert health.seen == ["SERVING"]
    assert_serves_correctly(server)
    assert len(live_placement_groups()) == 1
    FAULTS_SURVIVED["worker sigkill while idle"] += 1


def assert_unavailable_now(address: str) -> None:
    started = time.monotonic()
    with Client(address) as client, pytest.raises(RequestError) as refused:
        client.generate([5, 6, 7], max_tokens=2, timeout=30)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE, refused.value
    assert time.monotonic() - started < 5


def assert_serves_correctly(server: ServerThread) -> None:
    prompt = random_prompts([9], vocab_of(NAME), seed=32)[0]
    with Client(server.address) as client:
        result = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True, timeout=60)
    assert result.outputs[0].token_ids == hf_greedy(checkpoint_dir(NAME), tuple(prompt), 12)
    server.wait_pool_whole()


def wait_replaced(server: ServerThread, old_engine, health: HealthWatch, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while health.seen[-1] != "SERVING" or server.engine is old_engine:
        assert time.monotonic() < deadline, f"the engine never came back: {health.seen}"
        time.sleep(0.1)


def assert_only_the_new_engine_is_left() -> None:
    names = Counter(a["ActorClassName"] for a in alive_actors())
    assert names["EngineActor"] == 1 and names["RayWorkerActor"] == 2, names
    assert len(live_placement_groups()) == 1


def test_worker_group_that_cannot_come_back_fails_requests_then_supervisor_replaces_engine(server):
    old_engine = server.engine
    # Every restart now fails (as when a node lost the model files): the engine gives up.
    engine_call(server, lambda actor: setattr(actor.core, "model_dir", "/nonexistent/model"))
    with HealthWatch(server.address) as health:
        stream = Stream(server.address, [5, 6, 7, 8], max_tokens=200)
        stream.wait_tokens(2)
        kill_rank_with_sigkill(server)
        stream.join()
        assert stream.error is not None and stream.error.code == grpc.StatusCode.UNAVAILABLE
        assert "gave up after 1 restarts" in stream.error.message
        health.wait_for("NOT_SERVING", 30)
        assert_unavailable_now(server.address)
        wait_replaced(server, old_engine, health)
    assert health.seen == ["SERVING", "NOT_SERVING", "SERVING"]
    assert server.server.supervisor.num_restarts == 1
    assert_serves_correctly(server)
    assert_only_the_new_engine_is_left()
    FAULTS_SURVIVED["worker group beyond repair -> engine replaced"] += 1


def test_engine_actor_killed_is_unavailable_at_once_then_replaced(server):
    old_engine = server.engine
    restarts = server.server.supervisor.num_restarts
    with HealthWatch(server.address) as health:
        stream = Stream(server.address, [5, 6, 7, 8], max_tokens=200)
        stream.wait_tokens(2)
        killed_at = time.monotonic()
        ray.kill(old_engine.actor, no_restart=True)
        stream.join()
        assert stream.error is not None and stream.error.code == grpc.StatusCode.UNAVAILABLE
        assert stream.ended_at - killed_at < 5  # at once, not after some timeout
        health.wait_for("NOT_SERVING", 10)
        assert_unavailable_now(server.address)
        wait_replaced(server, old_engine, health)
    assert health.seen == ["SERVING", "NOT_SERVING", "SERVING"]
    assert server.server.supervisor.num_restarts == restarts + 1
    assert_serves_correctly(server)
    assert_only_the_new_engine_is_left()
    FAULTS_SURVIVED["engine actor killed -> engine replaced"] += 1


@pytest.mark.slow
def test_worker_group_beyond_repair_with_replay_on_streams_go_on_on_the_new_engine(server):
    """The same fault with replay on (frontend/replay.py): the requests the engine ended when it
    gave up go on on the supervisor's new engine, exactly as transformers' greedy run."""
    old_engine = server.engine
    prompt = random_prompts([11], vocab_of(NAME), seed=33)[0]
    expected = hf_greedy(checkpoint_dir(NAME), tuple(prompt), 120)
    replay = server.server.replay
    replay.recovery_timeout_s = 120.0
    try:
        engine_call(server, lambda actor: setattr(actor.core, "model_dir", "/nonexistent/model"))
        stream = Stream(server.address, prompt, max_tokens=120)
        stream.wait_tokens(2)
        kill_rank_with_sigkill(server)
        stream.join()
    finally:
        replay.recovery_timeout_s = 0.0
    assert stream.error is None, stream.error
    assert stream.tokens == expected and stream.finish_reason == "length"
    assert server.engine is not old_engine
    server.wait_pool_whole()
    assert_only_the_new_engine_is_left()
    FAULTS_SURVIVED["worker group beyond repair -> streams replayed on a new engine"] += 1
