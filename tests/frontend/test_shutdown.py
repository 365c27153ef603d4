"""Graceful shutdown (health flips first, streams in flight finish within the grace period, then
the engine actor, its TP workers and their placement group are gone) and a dying engine
(UNAVAILABLE at once, health NOT_SERVING, no hang)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import ray

from raypaged.client import Client, RequestError
from raypaged.config import EngineConfig
from raypaged.frontend.server import ServerConfig
from tests.support.checkpoints import checkpoint_dir
from tests.support.frontend_harness import ServerThread, init_ray
from tests.support.ray_state import alive_actors, live_placement_groups

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    init_ray()
    yield
    ray.shutdown()


def engine_config(**overrides) -> EngineConfig:
    return EngineConfig(model=str(checkpoint_dir("llama")), device="cpu", num_gpu_blocks_override=64,
                        max_num_seqs=4, **overrides)


def stream_in_thread(address: str, result: dict, **params) -> threading.Thread:
    def run():
        try:
            with Client(address) as c:
                chunks = []
                for chunk in c.stream([5, 6, 7, 8], temperature=0.0, ignore_eos=True, **params):
                    chunks.append(chunk)
                    result.setdefault("started", time.monotonic())
                result["chunks"] = chunks
        except RequestError as e:
            result["error"] = e
        finally:
            result["ended"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_started(result: dict, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while "started" not in result and "ended" not in result:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "started" in result, result


def test_graceful_shutdown_with_tensor_parallel_engine():
    server = ServerThread(engine_config(tensor_parallel_size=2))
    assert live_placement_groups(), "a TP engine holds a placement group"
    result: dict = {}
    thread = stream_in_thread(server.address, result, max_tokens=80)
    wait_started(result)
    shutdown = asyncio.run_coroutine_threadsafe(server.server.shutdown(grace_s=60), server.loop)
    with Client(server.address) as c:
        deadline = time.monotonic() + 5
        while c.health() != "NOT_SERVING":
            assert time.monotonic() < deadline
        with pytest.raises(RequestError) as refused:
            c.generate("hello", max_tokens=2)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in refused.value.message
    thread.join(timeout=60)
    chunks = result["chunks"]  # the stream in flight ran to its end
    assert sum(len(o.token_ids) for ch in chunks for o in ch.outputs) == 80
    assert chunks[-1].outputs[0].finish_reason == "length"
    shutdown.result(timeout=60)
    server.stop()
    deadline = time.monotonic() + 10  # ray.kill returns before the actor's process is gone
    while alive_actors() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive_actors() == [] and live_placement_groups() == []
    with Client(server.address) as c, pytest.raises(RequestError) as gone:
        c.health(timeout=2)
    assert gone.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_grace_period_bounds_the_wait():
    server = ServerThread(engine_config(), ServerConfig(port=0, shutdown_grace_s=0.05))
    result: dict = {}
    thread = stream_in_thread(server.address, result, max_tokens=240)
    wait_started(result)
    started = time.monotonic()
    server.stop(grace_s=0.05)
    thread.join(timeout=30)
    assert time.monotonic() - started < 20
    # Cut off by the server going away: an error status, not a hang and not a clean finish.
    assert result["error"].code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert alive_actors() == []


def test_dead_engine_is_unavailable_and_not_serving():
    server = ServerThread(engine_config())
    result: dict = {}
    thread = stream_in_thread(server.address, result, max_tokens=240)
    wait_started(result)
    ray.kill(server.engine.actor, no_restart=True)
    thread.join(timeout=30)
    assert result["error"].code == grpc.StatusCode.UNAVAILABLE
    with Client(server.address) as c:
        with pytest.raises(RequestError) as error:
            c.generate("hello", max_tokens=2, timeout=10)
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
        assert "engine" in error.value.message
        deadline = time.monotonic() + 10
        while c.health() != "NOT_SERVING":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    server.stop()
    assert alive_actors() == []


def test_stop_waiting_cuts_a_long_grace_short():
    """A second Ctrl-C: the drain stops waiting, the streams left are cancelled."""
    server = ServerThread(engine_config())
    result: dict = {}
    thread = stream_in_thread(server.address, result, max_tokens=240)
    wait_started(result)
    shutdown = asyncio.run_coroutine_threadsafe(server.server.shutdown(grace_s=600), server.loop)
    time.sleep(0.2)
    assert not shutdown.done()  # draining: the stream may take its time
    started = time.monotonic()
    server.loop.call_soon_threadsafe(server.server.service.stop_waiting)
    shutdown.result(timeout=30)
    assert time.monotonic() - started < 20
    thread.join(timeout=30)
    assert result["error"].code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    server.stop()
    assert alive_actors() == []
