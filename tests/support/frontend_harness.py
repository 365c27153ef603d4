"""A real raypaged gRPC server for tests: engine actor + FrontendServer on an event loop of their
own in a background thread, so tests talk to it with real gRPC clients (blocking or asyncio) and
read the engine's block counts through Ray.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import ray

from raypaged.config import EngineConfig
from raypaged.frontend.server import FrontendServer, ServerConfig

if TYPE_CHECKING:
    from raypaged.engine.client import AsyncEngineClient


def init_ray() -> None:
    """One small local Ray per test module (module-scoped fixtures call this)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


@contextmanager
def cpu_server(model_dir: str, **engine_config: Any) -> Iterator[ServerThread]:
    """A test module's server: Ray up, the frontend serving model_dir on the CPU with these
    engine settings; stopped and Ray down afterwards."""
    init_ray()
    running = ServerThread(EngineConfig(model=model_dir, device="cpu", **engine_config))
    try:
        yield running
    finally:
        running.stop()
        ray.shutdown()


class ServerThread:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig | None = None,
                 restart_engine: bool = False,
                 start_engine: Callable[[], Awaitable[AsyncEngineClient]] | None = None) -> None:
        """restart_engine: the server replaces a dead engine (frontend/supervisor.py).
        start_engine: how every engine is started (default: AsyncEngineClient.start(engine_config))."""
        from transformers import AutoTokenizer

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="server-loop", daemon=True)
        self._thread.start()
        config = server_config or ServerConfig(port=0, metrics_port=0, stats_interval_s=0.1)
        model = engine_config.model_settings
        self.tokenizer = AutoTokenizer.from_pretrained(model.tokenizer or model.model)

        async def start() -> FrontendServer:
            from raypaged.engine.client import AsyncEngineClient

            starter = start_engine or (lambda: AsyncEngineClient.start(engine_config))
            engine = await starter()
            factory = starter if restart_engine else None
            server = FrontendServer(engine, self.tokenizer, config, owns_engine=True, engine_factory=factory)
            await server.start()
            return server

        self.server: FrontendServer = self.call(start(), timeout=300)
        self.address = self.server.address
        self.num_blocks: int = self.engine.model_info["num_blocks"]

    @property
    def engine(self):
        return self.server.engine  # a new one after the supervisor replaced a dead engine

    def call(self, coroutine, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stats(self):
        return ray.get(self.engine.actor.stats.remote())["scheduler"]

    def wait_until(self, condition: Callable[[Any], bool], timeout: float = 10.0, what: str = "") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if condition(stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what or condition}: {stats}")
            time.sleep(0.02)

    def wait_pool_whole(self, timeout: float = 10.0):
        """No request held, every block back in the pool."""
        return self.wait_until(
            lambda s: s.num_running == 0 and s.num_waiting == 0
            and s.kv_cache.num_free_blocks == self.num_blocks, timeout, "the pool to be whole")

    def stop(self, grace_s: float = 5.0) -> None:
        try:
            self.call(self.server.shutdown(grace_s), timeout=grace_s + 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
