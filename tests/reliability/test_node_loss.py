"""A node lost while a TP=2 engine (CPU, gloo) serves, on a Ray cluster of several nodes on one
host (tests/support/node_cluster.py), seen from real gRPC clients of a live server whose
supervisor replaces a dead engine.

- The node holding the engine's workers is lost (a node with room joined first): the engine
  notices at its next step, its new worker group is placed on the capacity left, the KV pool is
  rebuilt and every request in flight recomputes; each stream gives the tokens of a fault-free
  run (greedy: transformers'; n = 2 seeded sampling: the same server's fault-free run), the
  engine actor is the same one, the pool ends whole.
- The node holding the engine actor and its workers is lost: the supervisor starts a new engine
  on a live node and the streams go on there (frontend/replay.py) with the same tokens; nothing
  of the old engine is left (actors, placement group).
- The workers' node is lost and no capacity is left: the engine gives up after its bounded
  placement wait, the supervisor's engines cannot place their workers either, and within the
  bound the streams and a request sent meanwhile end with UNAVAILABLE, never a hang. Once a node
  joins, the server serves again, correctly.

The head node (this process: the server, and the engine actor unless a test moves it) has no
CPU, so every worker group goes to the one worker node with room. The tests run in order, each
leaving the server SERVING with a whole pool. They run in the slow suite (scripts/test-slow);
the default suite has the bounded placement wait (tests/executor/test_ray_tp.py).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raypaged.client import Client, RequestError
from raypaged.config import EngineConfig
from raypaged.engine.client import AsyncEngineClient
from raypaged.frontend.server import ServerConfig
from raypaged.frontend.supervisor import RestartPolicy
from tests.support.checkpoints import checkpoint_dir
from tests.support.frontend_harness import ServerThread
from tests.support.hf_oracle import hf_greedy, random_prompts, vocab_of
from tests.support.node_cluster import NodeCluster, engine_nodes
from tests.support.ray_state import alive_actors, live_placement_groups
from tests.support.streams import Stream

# Over a minute on 2 cores (three raylets, an engine, a new worker group per test): slow.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAME = "llama"
MAX_TOKENS = 64
FAULT_AFTER = 4  # tokens every stream has before its node is lost
PLACEMENT_S = 3.0  # how long a worker group waits for capacity
# How long streams wait for a new engine, and for a stream to end: an engine starts in seconds
# here, in minutes on a machine busy with other work.
RECOVERY_S = 400.0
OUTAGE_S = 10.0  # the bound the test of an outage with no capacity left sets instead
WORKER_NODE = {"num_cpus": 1}  # room for one TP=2 group of CPU workers (0.25 CPU each)


@dataclass
class Env:
    cluster: NodeCluster
    worker_node: str  # the worker node with room for a group: where the engine's workers run
    engine_home: str  # where the next engine actor starts (a live node: the tests set it)
    server: ServerThread | None = None

    @property
    def running(self) -> ServerThread:
        assert self.server is not None
        return self.server

    async def start_engine(self, config: EngineConfig) -> AsyncEngineClient:
        home = NodeAffinitySchedulingStrategy(self.engine_home, soft=False)
        return await AsyncEngineClient.start(config, scheduling_strategy=home)


@pytest.fixture(scope="module")
def env():
    cluster = NodeCluster()
    env = Env(cluster, worker_node=cluster.add_node(**WORKER_NODE), engine_home=cluster.head_id)
    config = EngineConfig(model=str(checkpoint_dir(NAME)), device="cpu", tensor_parallel_size=2,
                          block_size=8, num_gpu_blocks_override=128, max_num_seqs=8,
                          max_num_batched_tokens=16, max_worker_restarts=1, step_timeout_s=30.0,
                          placement_timeout_s=PLACEMENT_S)
    try:
        env.server = ServerThread(
            config, ServerConfig(port=0, stats_interval_s=0.1, restart_policy=RestartPolicy(
                # Restarts that cannot place their workers back off to one every few seconds:
                # each starts a process, and a node must find the CPU to join meanwhile.
                initial_backoff_s=0.2, max_backoff_s=4.0, recovery_timeout_s=RECOVERY_S)),
            restart_engine=True, start_engine=lambda: env.start_engine(config))
        yield env
    finally:
        if env.server is not None:
            env.server.stop()
        cluster.shutdown()


def requests(seed: int) -> list[tuple[list[int], dict]]:
    """Greedy streams (one in a prefill chunk, one sharing the other's prefix) and an n = 2
    seeded sampled one."""
    vocab = vocab_of(NAME)
    [prefix] = random_prompts([16], vocab, seed=seed)
    prompts = random_prompts([5, 27], vocab, seed=seed + 1) + random_prompts([6], vocab, seed + 2, prefix=prefix)
    common = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [(prompts[0], dict(temperature=0.0, **common)), (prompts[1], dict(temperature=0.0, **common)),
            (prompts[2], dict(temperature=0.0, **common)), (prefix, dict(n=2, temperature=0.9, seed=5, **common))]


def expected_outputs(server: ServerThread, reqs: list[tuple[list[int], dict]]) -> list[list[list[int]]]:
    """Greedy: transformers' tokens; sampled: this server's fault-free run."""
    out = []
    for prompt, params in reqs:
        if params["temperature"] == 0.0:
            out.append([hf_greedy(checkpoint_dir(NAME), tuple(prompt), MAX_TOKENS)])
        else:
            out.append(Stream(server.address, prompt, **params).join(RECOVERY_S).tokens)
    server.wait_pool_whole()
    return out


def start_streams(server: ServerThread, reqs: list[tuple[list[int], dict]]) -> list[Stream]:
    streams = [Stream(server.address, prompt, **params) for prompt, params in reqs]
    for stream in streams:
        stream.wait_tokens(FAULT_AFTER, timeout_s=RECOVERY_S)
    return streams


def engine_call(server: ServerThread, fn):
    return ray.get(server.engine.actor.__ray_call__.remote(fn), timeout=60)


def wait_replaced(server: ServerThread, old_engine, timeout_s: float = RECOVERY_S) -> None:
    deadline = time.monotonic() + timeout_s
    while server.engine is old_engine or not server.engine.is_alive:
        assert time.monotonic() < deadline, "the engine never came back"
        time.sleep(0.05)


def assert_one_engine_left(cluster: NodeCluster, server: ServerThread) -> None:
    names = Counter(a["ActorClassName"] for a in alive_actors())
    assert names["EngineActor"] == 1 and names["RayWorkerActor"] == 2, names
    assert len(live_placement_groups()) == 1
    where = engine_nodes(server.engine.actor)
    assert cluster.alive(where.engine) and all(cluster.alive(n) for n in where.workers)


def test_workers_node_lost_group_moves_to_the_capacity_left(env):
    cluster, server = env.cluster, env.running
    reqs = requests(seed=81)
    expected = expected_outputs(server, reqs)
    engine = server.engine
    before = engine_nodes(engine.actor)
    assert before.engine == cluster.head_id and set(before.workers) == {env.worker_node}
    restarts = engine_call(server, lambda actor: actor.core.num_worker_restarts)

    spare = cluster.add_node(**WORKER_NODE)
    streams = start_streams(server, reqs)
    lost_at = time.monotonic()
    cluster.lose_node(env.worker_node)
    env.worker_node = spare
    assert all(stream.ended_at is None for stream in streams)  # the fault hit each mid-way
    for stream, want in zip(streams, expected):
        stream.join(RECOVERY_S)
        assert stream.error is None, stream.error
        assert stream.tokens == want  # no token lost, none repeated, none changed
        assert set(stream.finish) == {"length"}
    print(f"\nworkers' node lost: streams done {time.monotonic() - lost_at:.1f} s after")
    assert server.engine is engine  # the engine actor lived through it
    assert engine_call(server, lambda actor: actor.core.num_worker_restarts) == restarts + 1
    assert set(engine_nodes(engine.actor).workers) == {env.worker_node}
    server.wait_pool_whole()
    assert_one_engine_left(cluster, server)


def move_engine_to(env: Env, node: str) -> None:
    """The next engine starts on `node`: this one is killed and replaced (no stream in flight)."""
    server = env.running
    env.engine_home = node
    old = server.engine
    ray.kill(old.actor, no_restart=True)
    wait_replaced(server, old)
    assert engine_nodes(server.engine.actor).engine == node


def test_node_of_engine_and_workers_lost_streams_go_on_on_a_new_engine(env):
    cluster, server = env.cluster, env.running
    move_engine_to(env, env.worker_node)
    before = engine_nodes(server.engine.actor)
    assert set(before.workers) == {before.engine}  # everything on one node
    reqs = requests(seed=82)
    expected = expected_outputs(server, reqs)
    old_engine = server.engine
    replayed = server.server.replay.num_replayed

    spare = cluster.add_node(**WORKER_NODE)
    streams = start_streams(server, reqs)
    lost = env.worker_node
    env.engine_home = cluster.head_id  # where the replacement starts
    lost_at = time.monotonic()
    cluster.lose_node(lost)
    env.worker_node = spare
    assert all(stream.ended_at is None for stream in streams)
    for stream, want in zip(streams, expected):
        stream.join(RECOVERY_S)
        assert stream.error is None, stream.error
        assert stream.tokens == want
        assert set(stream.finish) == {"length"}
    print(f"\nengine's node lost: streams done {time.monotonic() - lost_at:.1f} s after")
    assert server.engine is not old_engine
    assert server.server.replay.num_replayed == replayed + len(streams)
    after = engine_nodes(server.engine.actor)
    assert lost not in {after.engine, *after.workers}
    server.wait_pool_whole()
    assert_one_engine_left(cluster, server)


def test_no_capacity_left_streams_end_unavailable_within_the_bound(env):
    cluster, server = env.cluster, env.running
    assert engine_nodes(server.engine.actor).engine == cluster.head_id
    [prompt] = random_prompts([9], vocab_of(NAME), seed=83)
    old_engine = server.engine
    [stream] = start_streams(server, [(prompt, dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))])
    server.server.replay.recovery_timeout_s = OUTAGE_S
    try:
        lost_at = time.monotonic()
        cluster.lose_node(env.worker_node)  # nowhere left for a worker group
        meanwhile = Stream(server.address, prompt, temperature=0.0, max_tokens=4)
        stream.join(RECOVERY_S)
        meanwhile.join(RECOVERY_S)
        took = time.monotonic() - lost_at
    finally:
        server.server.replay.recovery_timeout_s = RECOVERY_S
    # Noticed within a step; one placement wait, then the outage's bound (the supervisor's
    # engines cannot place their workers either); seconds of slack for a loaded machine.
    assert took < PLACEMENT_S + OUTAGE_S + 30, took
    for ended in (stream, meanwhile):
        assert ended.error is not None and ended.error.code == grpc.StatusCode.UNAVAILABLE, ended.error
    assert 0 < len(stream.tokens[0]) < MAX_TOKENS
    print(f"\nno capacity left: streams ended UNAVAILABLE {took:.1f} s after the node was lost")

    # Capacity returns: the supervisor's next engine places its workers and serves correctly.
    env.worker_node = cluster.add_node(**WORKER_NODE)
    wait_replaced(server, old_engine)
    with Client(server.address) as client:
        deadline = time.monotonic() + RECOVERY_S
        while (status := client.health()) != "SERVING":
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        try:
            result = client.generate(prompt, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        except RequestError as e:
            raise AssertionError(f"the server does not serve once capacity returned: {e}") from None
    assert result.outputs[0].token_ids == hf_greedy(checkpoint_dir(NAME), tuple(prompt), MAX_TOKENS)
    server.wait_pool_whole()
    assert_one_engine_left(cluster, server)
