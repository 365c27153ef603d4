"""The central engine actor: EngineCore stepping in a background thread inside one Ray actor.

Callers add and abort requests at any time (the actor is threaded, so these calls never wait
for a step), and pull outputs with `get_outputs`: one call per step carries every request's new
tokens, never one Ray object per token.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from raypaged.config import EngineConfig
from raypaged.core.errors import EngineDeadError
from raypaged.core.outputs import EngineCoreOutputs, EngineLoad
from raypaged.core.request import Request
from raypaged.engine.core import EngineCore

logger = logging.getLogger(__name__)


class EngineActor:
    """Run as `ray.remote(EngineActor).options(max_concurrency=…)` (see engine/client.py)."""

    def __init__(self, config: EngineConfig) -> None:
        # Timestamped as `raypaged launch` logs: a fault's engine-side events (a worker group
        # failed, restarted) are read against the frontend's in one interleaved log.
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.core = EngineCore(config)
        self.core.record_cache_events()  # taken every step below, carried on the outputs
        self._outputs = EngineCoreOutputs()  # steps' records the caller has not pulled yet
        self._have_outputs = threading.Condition()
        self._have_work = threading.Event()
        self._stopping = threading.Event()
        self._loop_error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def model_info(self) -> dict[str, Any]:
        core = self.core
        return {
            "model_dir": core.model_dir,
            "architecture": core.model_config.architecture,
            "max_model_len": core.max_model_len,
            "vocab_size": core.model_config.vocab_size,
            "block_size": core.config.scheduler.block_size,
            "num_blocks": core.num_blocks,
            "kv_cache_dtype": core.config.cache.kv_cache_dtype,
            "kv_cache_bytes_per_block": core.kv_cache_bytes[0],
            "kv_cache_element_bytes": core.kv_cache_bytes[1],
            "tensor_parallel_size": core.config.parallel.tensor_parallel_size,
            "eos_token_ids": list(core.eos_token_ids),
            "enable_prefix_caching": core.config.scheduler.enable_prefix_caching,
            "prefix_caching_hash_algo": core.config.scheduler.prefix_caching_hash_algo,
        }

    def add_request(self, request: Request) -> None:
        """Raises InvalidRequestError (or QueueFullError) at once, leaving nothing behind."""
        self._check_alive()
        self.core.add_request(request)
        self._have_work.set()

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)
        self._have_work.set()

    def get_outputs(self, timeout_s: float = 1.0) -> EngineCoreOutputs:
        """Everything produced since the last call; waits up to timeout_s for something."""
        self._check_alive()
        with self._have_outputs:
            if not self._outputs and not self._outputs.cache_events:
                if self.core.dead is not None:
                    # The engine gave up on its workers and its failed requests' records are
                    # out: from now on the caller learns it is gone (and can replace it).
                    raise EngineDeadError(self.core.dead)
                self._have_outputs.wait(timeout_s)
            outputs, self._outputs = self._outputs, EngineCoreOutputs()
        scheduler = self.core.scheduler
        # Unlocked reads of two counts and a ratio: a snapshot a step stale at most is all the
        # frontend's shedding needs, and it must not wait for a step to finish.
        outputs.load = EngineLoad(scheduler.num_waiting, scheduler.num_running,
                                  scheduler.kv_cache_manager.usage)
        return outputs

    def stats(self) -> dict[str, Any]:
        scheduler = self.core.scheduler
        with self.core._lock:
            return {"scheduler": scheduler.stats(), "num_running": scheduler.num_running,
                    "num_waiting": scheduler.num_waiting}

    def worker_pids(self) -> list[int]:
        return self.core.executor.worker_pids()

    def shutdown(self) -> None:
        self._stopping.set()
        self._have_work.set()
        self._thread.join(timeout=30)
        self.core.shutdown()

    def _publish(self, outputs: EngineCoreOutputs) -> None:
        """A step's records (and the cache events since the last), out to get_outputs."""
        events = self.core.take_cache_events()
        if events:
            outputs.cache_events += events
        if outputs or events:
            with self._have_outputs:
                if self._outputs or self._outputs.cache_events:
                    self._outputs.extend(outputs)
                else:
                    self._outputs = outputs
                self._have_outputs.notify_all()

    def _check_alive(self) -> None:
        if self._loop_error is not None:
            raise RuntimeError(f"the engine loop died: {self._loop_error}")

    def _loop(self) -> None:
        interval = self.core.config.parallel.worker_health_check_interval_s
        workers_seen_at = time.monotonic()  # by a step or a health check
        try:
            while not self._stopping.is_set():
                if not self.core.has_unfinished_requests():
                    self._have_work.wait(0.05)
                    self._have_work.clear()
                    if interval and time.monotonic() - workers_seen_at >= interval:
                        workers_seen_at = time.monotonic()
                        self._publish(self.core.check_workers())
                    continue
                workers_seen_at = time.monotonic()  # a step checks the workers itself
                self._publish(self.core.step())
        except Exception as e:  # the engine is unusable; callers get a clear error from now on
            logger.exception("engine loop died")
            self._loop_error = f"{type(e).__name__}: {e}"
            with self._have_outputs:
                self._have_outputs.notify_all()
