"""EngineCore: the loop at the centre. One step = schedule → execute → update.

It owns the scheduler (and through it the KV block manager) and an executor that drives the
workers. It knows nothing of text: requests arrive as token ids and leave as token ids.

Two step functions, as the scheduler's class asks (config.async_scheduling): step() answers each
step in the call that scheduled it; step_with_batch_queue() (AsyncScheduler) schedules and starts
step N+1, then takes step N's answer. Callers call step(), which runs the pipelined one when the
scheduler is an AsyncScheduler.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from raypaged.config import ConfigError, EngineConfig
from raypaged.core.async_scheduler import AsyncScheduler, make_scheduler
from raypaged.core.errors import EngineDeadError, InvalidRequestError, UnknownRequestError
from raypaged.core.outputs import EngineCoreOutputs, KVCopyTimes, NewRequestData, SchedulerOutput
from raypaged.core.parallel_sampling import end_records
from raypaged.core.request import ENGINE_FAILED, FinishReason, Request, RequestStatus
from raypaged.engine.kv_managers import kv_cache_manager_for
from raypaged.executor.base import Executor
from raypaged.executor.errors import WorkerGroupError
from raypaged.model.config import ModelConfig

if TYPE_CHECKING:
    from raypaged.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


def eos_token_ids(model_config: ModelConfig) -> tuple[int, ...]:
    """EOS ids as transformers' generate uses them: generation_config.json over config.json."""
    path = os.path.join(model_config.model_dir or "", "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return model_config.eos_token_ids


def resolve_model_dir(config: EngineConfig) -> str:
    if config.model_settings.model is not None:
        return config.model_settings.model
    from raypaged.demo import demo_model_path

    return demo_model_path()


def default_executor_class(config: EngineConfig) -> type[Executor]:
    if config.parallel.uses_ray_workers:
        from raypaged.executor.ray_executor import RayExecutor

        return RayExecutor
    from raypaged.executor.uniproc import UniprocExecutor

    return UniprocExecutor


class EngineCore:
    # Structured outputs' manager, built on the first request with a grammar (a class default:
    # an engine without one, or built around __init__ as tests do, never touches xgrammar).
    _structured: StructuredOutputManager | None = None

    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        """Raises ConfigError (ModelConfigError: one the checkpoint rules out) for settings
        that can never work, before any worker starts."""
        config.validate()
        self.config = config
        self.model_dir = resolve_model_dir(config)
        self.model_config = ModelConfig.from_pretrained(self.model_dir, config.scheduler.max_model_len)
        self.model_config.check_tensor_parallel(config.parallel.tensor_parallel_size)
        self.eos_token_ids = eos_token_ids(self.model_config)
        self.max_model_len = self.model_config.max_model_len
        self.max_num_batched_tokens = config.scheduler.token_budget(self.max_model_len)

        if executor_class is None:
            executor_class = default_executor_class(config)
        self.executor = executor_class(config, self.model_dir)
        self.num_blocks = self.executor.determine_num_blocks(self.max_model_len,
                                                             self.max_num_batched_tokens)
        self.executor.initialize_cache(self.num_blocks, self.max_model_len)
        # (bytes of one block, of one value) on each rank: the metrics' and model_info's pool size.
        self.kv_cache_bytes = self.executor.collective_rpc("kv_cache_sizes")[0]
        try:
            kv_cache_manager = kv_cache_manager_for(config, self.model_config, self.executor,
                                                    self.num_blocks, self.max_num_batched_tokens)
        except (ConfigError, ValueError):
            self.executor.shutdown()
            raise
        self.scheduler = make_scheduler(config.scheduler.build(self.num_blocks, self.max_model_len),
                                        kv_cache_manager=kv_cache_manager)
        self._pending_outputs = EngineCoreOutputs()  # abort records, out with the next step
        # Queue time (added → first scheduled, vLLM's request_queue_time_seconds), measured here
        # on one clock and handed to the frontend with the request's next output.
        self._queued_since: dict[str, float] = {}
        self._queue_times: dict[str, float] = {}
        # One thread steps; others add and abort. The lock is held for bookkeeping only, never
        # while the workers run the model.
        self._lock = threading.Lock()
        self._executor_class = executor_class
        self._consecutive_failures = 0
        self.num_worker_restarts = 0
        # The host tier's copy times: the workers' running totals start at zero in each new
        # group, so those of the groups before it are carried here (the stats never go down).
        self._copy_times_before = KVCopyTimes()
        self._copy_times = KVCopyTimes()  # the current group's, as last reported
        self.dead: str | None = None  # set once the workers cannot be brought back
        # Everything allocated so far lives as long as the engine: keep the collector from
        # rescanning it on every step (the scheduler allocates a few objects per request per step).
        gc.freeze()
        logger.info("engine ready: %s, %d KV blocks of %d tokens (%s, %d bytes a block per rank), "
                    "max_model_len %d", self.model_config.architecture, self.num_blocks,
                    config.scheduler.block_size, config.cache.kv_cache_dtype,
                    self.kv_cache_bytes[0], self.max_model_len)

    def add_request(self, request: Request) -> None:
        """Queue a request (its sampling params already validated). EOS comes from the model
        unless the caller set one; a model with several EOS ids stops on any of them."""
        eos_ids = self.eos_token_ids
        if request.eos_token_id is None and eos_ids:
            request.eos_token_id = eos_ids[0]
            extra = tuple(t for t in eos_ids[1:] if t not in request.sampling_params.stop_token_ids)
            if extra and not request.sampling_params.ignore_eos:
                request.sampling_params = dataclasses.replace(
                    request.sampling_params,
                    stop_token_ids=request.sampling_params.stop_token_ids + extra)
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        request.sampling_params.check_logit_bias(self.model_config.vocab_size)
        spec = request.sampling_params.structured_output
        if spec is not None:
            structured = self._structured_outputs()
            structured.validate(spec)  # InvalidRequestError naming the problem, nothing queued
            with self._lock:
                if structured.holds(request.request_id):
                    raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
                self.scheduler.check_request(request)
                structured.add(request)  # queued in the scheduler once its grammar compiled
                self._queued_since[request.request_id] = time.monotonic()
            return
        with self._lock:
            self.scheduler.add_request(request)
            self._queued_since[request.request_id] = time.monotonic()

    def _structured_outputs(self) -> StructuredOutputManager:
        if self._structured is None:
            from raypaged.structured.manager import StructuredOutputManager

            settings = self.config.model_settings
            self._structured = StructuredOutputManager(
                settings.tokenizer or self.model_dir, self.model_config.vocab_size,
                self.eos_token_ids, settings.structured_output_compile_timeout_s)
        return self._structured

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar compiled; end those whose compile failed or timed
        out (their records go out with this step). Under the lock."""
        structured = self._structured
        if structured is None or not structured.num_compiling:
            return
        ready, failed = structured.poll()
        for request in ready:
            try:
                self.scheduler.add_request(request)
            except InvalidRequestError as e:  # e.g. the waiting queue filled meanwhile
                failed.append((request, str(e)))
        for request, error in failed:
            self._end_unqueued(request, error)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort what is still held; ids that already finished are a benign race, not an error.
        The abort records go out with the next step's outputs."""
        with self._lock:
            for request_id in request_ids:
                held = self._structured.abort(request_id) if self._structured is not None else None
                if held is not None:
                    self._end_unqueued(held, None)
                    continue
                try:
                    aborted = self.scheduler.abort_requests([request_id])
                except UnknownRequestError:
                    continue
                for out in aborted:
                    self._pending_outputs.append(out)

    def _end_unqueued(self, request: Request, error: str | None) -> None:
        """End a request the scheduler never took (its grammar compiling or failed): aborted,
        with `error` when the engine failed it."""
        request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
        for out in end_records(request):
            out.error = error
            self._pending_outputs.append(out)

    def has_unfinished_requests(self) -> bool:
        compiling = self._structured is not None and self._structured.num_compiling > 0
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs) or compiling

    def record_cache_events(self) -> None:
        """Keep the prefix cache's events for take_cache_events (the engine actor does, every step)."""
        with self._lock:
            self.scheduler.kv_cache_manager.record_cache_events()

    def take_cache_events(self) -> list[int]:
        with self._lock:
            return self.scheduler.kv_cache_manager.take_cache_events()

    def step(self) -> EngineCoreOutputs:
        """One engine step: schedule, execute, update; the workers answer the step in this call.
        Returns its records, after the abort records since the last step. Under asynchronous
        scheduling (an AsyncScheduler) the step is step_with_batch_queue."""
        if isinstance(self.scheduler, AsyncScheduler):
            return self.step_with_batch_queue()
        self._wait_for_grammars()
        with self._lock:
            self._admit_compiled()
            outputs = self._take_outputs()
            if not self.scheduler.has_unfinished_requests():
                return self._idle(outputs)
            scheduler_output = self._schedule()
        return self._execute_and_update(scheduler_output, scheduler_output, outputs)

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """Asynchronous scheduling: schedule step N+1 and start it; the workers return step N's
        sampled tokens as they start N+1 (nothing for the first step in flight), and those
        are the step's update. The scheduler's in-flight queue is the batch queue."""
        scheduler = self.scheduler
        assert isinstance(scheduler, AsyncScheduler)
        self._wait_for_grammars()
        with self._lock:
            self._admit_compiled()
            outputs = self._take_outputs()
            if not scheduler.has_unfinished_requests():
                return self._idle(outputs)
            answered = scheduler.oldest_in_flight()
            scheduler_output = self._schedule()
        return self._execute_and_update(scheduler_output, answered, outputs)

    def _wait_for_grammars(self) -> None:
        """Nothing but compiles to wait for: block briefly on them rather than spin the loop."""
        structured = self._structured
        if (structured is not None and structured.num_compiling
                and not self.scheduler.has_unfinished_requests() and not self._pending_outputs):
            structured.wait(0.01)

    def _take_outputs(self) -> EngineCoreOutputs:
        outputs, self._pending_outputs = self._pending_outputs, EngineCoreOutputs()
        return outputs

    def _idle(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Nothing to schedule: only abort records, whose requests leave the queue clock."""
        if self._queued_since:
            self._attach_queue_times(outputs)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        if self._structured is not None:
            self._structured.fill_bitmask(scheduler_output, self.scheduler.requests,
                                          self.scheduler.has_group)
        if self._queued_since:
            self._note_first_scheduled(scheduler_output.scheduled_new_reqs)
        return scheduler_output

    def _execute_and_update(self, scheduler_output: SchedulerOutput,
                            answered: SchedulerOutput | None,
                            outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Run scheduler_output on the workers and hand their answer, which answers the step
        `answered` (None: none, the first step in flight), to the scheduler."""
        try:
            model_output = self.executor.execute_model(scheduler_output)
        except WorkerGroupError as e:
            outputs.extend(self._recover(f"the model workers failed: {e}"))
        else:
            self._consecutive_failures = 0
            with self._lock:
                if model_output is not None and model_output.kv_copy_times is not None:
                    self._copy_times = model_output.kv_copy_times
                    self.scheduler.kv_cache_manager.record_copy_times(
                        self._copy_times_before + self._copy_times)
                if answered is None:
                    assert isinstance(self.scheduler, AsyncScheduler)
                    update = self.scheduler.take_pending_outputs()
                else:
                    # A step in flight was answered, so the workers sent its output back.
                    assert model_output is not None
                    update = self.scheduler.update_from_output(answered, model_output)
            if outputs:
                outputs.extend(update)
            else:
                outputs = update  # the usual step: no abort records before it, nothing to copy
        return self._with_queue_times(outputs)

    def _with_queue_times(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        if self._queued_since or self._queue_times:
            self._attach_queue_times(outputs)
        return outputs

    def _note_first_scheduled(self, new_reqs: list[NewRequestData]) -> None:
        now = time.monotonic()
        for new in new_reqs:  # a preempted request comes back here too: only its first time counts
            since = self._queued_since.pop(new.req_id, None)
            if since is not None:
                self._queue_times[new.req_id] = now - since

    def _attach_queue_times(self, outputs: EngineCoreOutputs) -> None:
        # A request's first record is always kept whole (see EngineCoreOutputs), and a record
        # that finishes one too: the plain records never need a look.
        for out in outputs.whole_records():
            queue_time = self._queue_times.pop(out.req_id, None)
            if queue_time is not None:
                out.queue_time_s = queue_time
            if out.finish_reason is not None:  # aborted while waiting: never scheduled
                self._queued_since.pop(out.req_id, None)

    def check_workers(self) -> EngineCoreOutputs:
        """Between steps: the executor's health check, and the same recovery as a failed step
        when it fails (an idle engine otherwise finds a dead worker only when the next request
        waits on it). Returns the records of requests failed if the engine gave up."""
        if self.dead is not None:
            return EngineCoreOutputs()
        try:
            self.executor.check_health()
        except WorkerGroupError as e:
            return self._recover(f"the model workers failed: {e}")
        self._consecutive_failures = 0
        return EngineCoreOutputs()

    def _recover(self, message: str) -> EngineCoreOutputs:
        """A worker died or hung: restart the whole group (a rank cannot rejoin a broken process
        group) and recompute every in-flight request from its prompt plus the tokens already
        produced, as a preemption would, so callers see no gap and no repeat. After
        max_worker_restarts failures in a row, fail the requests and refuse new ones."""
        logger.error("%s; restarting the worker group", message)
        with self._lock:
            self.scheduler.reset_workers()
            if self._structured is not None:
                self._structured.reset_workers()
        while self._consecutive_failures < self.config.parallel.max_worker_restarts:
            self._consecutive_failures += 1
            self.num_worker_restarts += 1
            try:
                self._restart_workers()
                return EngineCoreOutputs()
            except Exception as e:  # noqa: BLE001 - any failure to start counts as one attempt
                logger.error("worker group restart %d failed: %s", self._consecutive_failures, e)
                message = f"{message}; restart failed: {e}"
        self.dead = f"{message} (gave up after {self.config.parallel.max_worker_restarts} restarts)"
        with self._lock:
            failed = self.scheduler.abort_requests(list(self.scheduler.requests)) \
                if self.scheduler.requests else []
        outputs = EngineCoreOutputs()
        for out in failed:
            out.error, out.stop_reason = self.dead, ENGINE_FAILED
            outputs.append(out)
        return outputs

    def _restart_workers(self) -> None:
        # Each phase timed in the log: a restart is bounded by the sum of their timeouts, and
        # which one a slow recovery spent its time in is otherwise invisible.
        started = time.monotonic()
        try:
            self.executor.shutdown()
        except Exception:  # the group is already broken; what matters is the new one
            logger.debug("executor shutdown after failure", exc_info=True)
        shut_down = time.monotonic()
        self._copy_times_before += self._copy_times
        self._copy_times = KVCopyTimes()
        self.executor = self._executor_class(self.config, self.model_dir)
        self.executor.initialize_cache(self.num_blocks, self.max_model_len)
        logger.info("worker group restarted: old group shut down in %.1f s, new one up in %.1f s",
                    shut_down - started, time.monotonic() - shut_down)

    def shutdown(self) -> None:
        if self._structured is not None:
            self._structured.shutdown()
        self.executor.shutdown()
