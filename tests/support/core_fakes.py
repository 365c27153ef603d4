"""Test doubles for the core: a worker that applies SchedulerOutput diffs to a fake paged KV pool,
and a brute-force check of every bookkeeping invariant of the scheduler and KV cache manager.

The fake pool stores, in each slot, the identity of the whole prefix whose K/V a real model would
have written there (a chained hash over the tokens up to that position). A request "attends" by
reading its block table: every position it reads must hold its own prefix's identity. That is
the end-to-end property paged attention needs — it catches a wrong prefix-cache hit, a missing or
misplaced copy-on-write, a block reused while still held, and a diff the worker applied wrong.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from raypaged.core.kv_cache_manager import KVCacheManager, cdiv
from raypaged.core.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, FinishReason, Request, RequestStatus
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler
from raypaged.engine.core import EngineCore


def make_request(request_id: str, prompt: list[int], *, eos: int | None = None, priority: int = 0,
                 salt: str | None = None, arrival: float = 0.0, **params) -> Request:
    return Request(request_id, prompt, SamplingParams(**params), eos_token_id=eos,
                   arrival_time=arrival, priority=priority, cache_salt=salt)


def prefix_ids(tokens: list[int]) -> list[int]:
    """prefix_ids(t)[p] identifies t[:p+1]: equal iff the whole prefixes are equal (for tests)."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


@dataclass
class _WorkerRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    n: int
    group_block_ids: list[list[int]]  # one table per KV-cache group
    num_computed: int
    logprobs: bool  # asked for: its sampled tokens come with logprobs

    @property
    def block_ids(self) -> list[int]:
        return self.group_block_ids[0]


class ShadowWorker:
    """Applies each step's diff like worker/model_runner.py, checks it, and answers with tokens
    drawn by `sample(req_id, position) -> int` (position: where the token goes in the request's
    tokens; n > 1 fans out by calling it again).

    one_behind: as the runner under asynchronous scheduling, each call answers the previous
    step (the first answers nothing), and a placeholder token the diff brings is replaced by the
    token this worker sampled for that position in the previous step.

    windows: the KV-cache groups' sliding windows (None: full), as the manager's groups; one
    table per group per request, every group's layers written, and each group's reads checked
    over what its layers read: a full group every earlier position, a sliding one the window
    (p - W, p] of each query p. A slot holds (group, prefix id), so a block read through the
    wrong group's table, or reused by another request while still in a window, fails."""

    def __init__(self, num_blocks: int, block_size: int, sample: Callable[[str, int], int],
                 rng: random.Random | None = None, one_behind: bool = False,
                 windows: tuple[int | None, ...] = (None,)) -> None:
        self.block_size = block_size
        self.windows = windows
        self.kv: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.requests: dict[str, _WorkerRequest] = {}
        self.sample = sample
        self.rng = rng or random.Random(0)
        self.num_copies = 0
        self.one_behind = one_behind
        self._previous = ModelRunnerOutput()
        self._previous_tokens: dict[str, tuple[int, int]] = {}  # req id -> (position, token)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = self._execute(out)
        if not self.one_behind:
            return result
        previous, self._previous = self._previous, result
        return previous

    def _fill_placeholders(self) -> None:
        for req_id, (position, token) in self._previous_tokens.items():
            state = self.requests.get(req_id)
            if state is not None and position < len(state.token_ids) \
                    and state.token_ids[position] == PLACEHOLDER_TOKEN_ID:
                state.token_ids[position] = token
        self._previous_tokens = {}

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        B = self.block_size
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            assert req_id in self.requests, f"told to drop {req_id!r}, which it does not hold"
            del self.requests[req_id]
        assert not (out.finished_req_ids & out.preempted_req_ids)
        new_ids = [new.req_id for new in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        assert len(set(new_ids)) == len(new_ids) and not set(new_ids) & set(cached.req_ids)
        assert set(new_ids) | set(cached.req_ids) == set(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id!r} sent new while held"
            tables = new.group_block_ids or [new.block_ids]
            assert len(tables) == len(self.windows) and tables[0] == new.block_ids
            self.requests[new.req_id] = _WorkerRequest(list(new.token_ids), new.num_prompt_tokens,
                                                       new.sampling_params.n,
                                                       [list(t) for t in tables],
                                                       new.num_computed_tokens,
                                                       new.sampling_params.logprobs is not None)
        for req_id, token_ids, block_ids, num_computed in zip(
                cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.requests[req_id]
            assert num_computed == state.num_computed, (req_id, num_computed, state.num_computed)
            end = num_computed + len(token_ids)
            known = state.token_ids[num_computed:end]  # tokens it already had there must agree
            assert all(a == b or PLACEHOLDER_TOKEN_ID in (a, b) for a, b in zip(known, token_ids)), \
                f"{req_id!r}: diff rewrites known tokens"
            state.token_ids[num_computed:end] = token_ids
            grown = out.group_new_block_ids.get(req_id)
            if grown is None:  # only a grown table has an entry
                grown = [block_ids] if len(self.windows) == 1 or block_ids else [[]] * len(self.windows)
            assert len(grown) == len(self.windows) and grown[0] == block_ids
            for table, appended in zip(state.group_block_ids, grown):
                table.extend(appended)
        # Copy-on-write before the forward, as one gather then scatter.
        dsts = [dst for _, dst in out.block_copies]
        assert len(set(dsts)) == len(dsts) and not set(dsts) & {src for src, _ in out.block_copies}
        snapshot = [list(self.kv[src]) for src, _ in out.block_copies]
        for (_, dst), data in zip(out.block_copies, snapshot):
            self.kv[dst] = data
        self.num_copies += len(out.block_copies)
        if self.one_behind:
            self._fill_placeholders()

        # Forward: every scheduled request writes its new positions, then reads all it attends to.
        order = list(out.num_scheduled_tokens.items())
        for req_id, n in order:
            state = self.requests[req_id]
            c = state.num_computed
            assert n >= 1 and c + n <= len(state.token_ids), (req_id, c, n, len(state.token_ids))
            assert PLACEHOLDER_TOKEN_ID not in state.token_ids[: c + n], f"{req_id!r}: unfilled placeholder"
            assert len(state.block_ids) * B >= c + n, f"{req_id!r}: no slot for its tokens"
            ids = prefix_ids(state.token_ids[: c + n])
            for g, table in enumerate(state.group_block_ids):
                for pos in range(c, c + n):
                    assert table[pos // B] >= 0, f"{req_id!r} writes into a dropped block"
                    self.kv[table[pos // B]][pos % B] = (g, ids[pos])
        result = ModelRunnerOutput()
        for req_id, n in order:
            state = self.requests[req_id]
            c = state.num_computed
            ids = prefix_ids(state.token_ids[: c + n])
            for g, (window, table) in enumerate(zip(self.windows, state.group_block_ids)):
                # The step's queries c .. c+n-1 read from the earliest one's window on.
                for pos in range(0 if window is None else max(0, c - window + 1), c + n):
                    block = table[pos // B]
                    assert block >= 0, f"{req_id!r}: position {pos} of group {g} was dropped"
                    got = self.kv[block][pos % B]
                    assert got == (g, ids[pos]), f"{req_id!r} reads a wrong K/V at position {pos}"
            state.num_computed = c + n
            sampled: list[int] = []
            if c + n == len(state.token_ids):
                fan_out = state.n if len(state.token_ids) == state.num_prompt_tokens else 1
                sampled = [self.sample(req_id, c + n) for _ in range(fan_out)]
                self._previous_tokens[req_id] = (c + n, sampled[0])
            result.req_ids.append(req_id)
            result.sampled_token_ids.append(sampled)
            result.logprobs.append([{t: -1.0} for t in sampled] if sampled and state.logprobs else None)
        # Runners may answer in any order (the scheduler has a fast path for its own order).
        perm = list(range(len(result.req_ids)))
        if self.rng.random() < 0.5:
            self.rng.shuffle(perm)
        result.req_ids = [result.req_ids[i] for i in perm]
        result.sampled_token_ids = [result.sampled_token_ids[i] for i in perm]
        result.logprobs = [result.logprobs[i] for i in perm]
        return result


class ShadowExecutor:
    """A ShadowWorker behind the executor's execute_model, as EngineCore calls it."""

    def __init__(self, worker: ShadowWorker) -> None:
        self.worker = worker

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(scheduler_output)


class ShadowEngine(EngineCore):
    """EngineCore's own step functions (step, step_with_batch_queue) around a given scheduler and
    a ShadowWorker, without a model: __init__ sets only what stepping reads. The worker must
    answer one step behind (one_behind) when the scheduler is an AsyncScheduler."""

    def __init__(self, scheduler: Scheduler, worker: ShadowWorker) -> None:
        assert worker.one_behind == scheduler.async_scheduling
        self.scheduler = scheduler
        self.executor = ShadowExecutor(worker)
        self._lock = threading.Lock()
        self._pending_outputs = EngineCoreOutputs()
        self._queued_since: dict[str, float] = {}
        self._queue_times: dict[str, float] = {}
        self._consecutive_failures = 0


def check_invariants(scheduler: Scheduler, worker: ShadowWorker | None = None) -> None:
    """Every invariant of the scheduler and the paged KV manager, recomputed from scratch."""
    kv: KVCacheManager = scheduler.kv_cache_manager
    pool = kv.block_pool
    B = kv.block_size
    running, waiting = scheduler.running, list(scheduler.waiting)
    live = {r.request_id: r for r in running + waiting}
    assert len(live) == len(running) + len(waiting), "a request is both running and waiting"
    assert live.keys() == scheduler.requests.keys()
    assert len(running) <= scheduler.config.max_num_seqs
    assert all(r.status is RequestStatus.RUNNING for r in running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in waiting)

    tables = {rid: kv.get_block_ids(rid) for rid in live}
    assert set(kv._requests) <= set(live), "the manager holds state for a request that ended"
    for r in waiting:
        assert not tables[r.request_id], f"waiting {r.request_id!r} holds blocks"
        assert r.num_computed_tokens == 0
    holders: dict[int, list[tuple[Request, int]]] = {}
    for r in running:
        table = tables[r.request_id]
        c = r.num_computed_tokens
        assert len(table) == cdiv(c, B), f"{r.request_id!r}: {len(table)} blocks for {c} tokens"
        assert len(table) * B - c < B, "more than a block's tail unfilled"
        assert len(set(table)) == len(table)
        for index, b in enumerate(table):
            holders.setdefault(b, []).append((r, index))

    # Each block is free or held, and held exactly as often as tables name it.
    free = pool.free_block_ids()
    assert len(set(free)) == len(free) == pool.num_free_blocks
    for b in range(pool.num_blocks):
        count = len(holders.get(b, []))
        assert pool.ref_cnt[b] == count, f"block {b}: ref {pool.ref_cnt[b]} but {count} holders"
        assert (b in set(free)) == (count == 0)
    # A block in several tables is shared by prefix or fork: same position, same tokens up to
    # where each holder has computed, and the same fill for every holder.
    filled = 0
    for b, hs in holders.items():
        fills = {min(B, max(0, r.num_computed_tokens - index * B)) for r, index in hs}
        if len(hs) > 1:
            assert len({index for _, index in hs}) == 1, f"block {b} at different positions"
            assert len(fills) == 1, f"shared block {b} filled differently: {fills}"
            first, index = hs[0]
            end = min([(index + 1) * B] + [r.num_computed_tokens for r, _ in hs])
            for r, _ in hs[1:]:
                assert r.all_token_ids[:end] == first.all_token_ids[:end]
                assert r.cache_salt == first.cache_salt
        filled += max(fills)
    # Cached blocks are full, and the map and the per-block hashes agree.
    for b in range(pool.num_blocks):
        h = pool.block_hash[b]
        if h is not None:
            assert pool.get_cached_block(h) == b
            assert len(h.token_ids) == B
            for r, index in holders.get(b, []):
                assert tuple(r.all_token_ids[index * B:(index + 1) * B]) == h.token_ids
                assert r.num_computed_tokens >= (index + 1) * B
    assert pool.num_cached_blocks == sum(h is not None for h in pool.block_hash)

    stats = kv.stats()
    assert stats.allocated_slots == (pool.num_blocks - len(free)) * B
    assert stats.filled_slots == filled, (stats.filled_slots, filled)
    assert stats.logical_slots == sum(r.num_computed_tokens for r in running)
    assert stats.shared_saved_slots == stats.logical_slots - stats.filled_slots >= 0

    if worker is not None:  # the workers' view is the scheduler's
        on_workers = scheduler._on_workers
        # The worker may still hold what finished this step: it drops them next step.
        assert set(worker.requests) == on_workers | scheduler._finished_req_ids
        assert not on_workers & scheduler._finished_req_ids
        for rid in on_workers:
            r, state = live[rid], worker.requests[rid]
            assert r.status is RequestStatus.RUNNING
            assert state.block_ids == tables[rid], f"{rid!r}: worker table differs"
            # Under asynchronous scheduling the scheduler may hold a placeholder the worker has
            # not been sent yet, never one the worker holds unfilled.
            assert state.token_ids == r.all_token_ids[: len(state.token_ids)]
            assert state.num_computed == r.num_computed_tokens


def check_pool_whole(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert not scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    assert all(ref == 0 for ref in kv.block_pool.ref_cnt)
    stats = kv.stats()
    assert stats.allocated_slots == stats.filled_slots == stats.logical_slots == 0
    assert not kv._requests


class OutputLog:
    """Every record the scheduler hands out, checked against the requests it names: a request's
    records carry exactly its output tokens, in order, under its group id and sample index; its
    first record and its finishing one are whole (prompt and prefix-cache counts set); one
    record finishes it and none follows."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}  # every request seen live, finished ones included
        self.tokens: dict[str, list[int]] = {}
        self.ids: dict[str, tuple[str, int]] = {}  # req id -> (group id, sample index) of its records
        self.finished: dict[str, EngineCoreOutput] = {}

    def add(self, outputs: Iterable[EngineCoreOutput]) -> None:
        for out in outputs:
            assert out.req_id not in self.finished, f"{out.req_id!r}: a record after its finish"
            first = out.req_id not in self.tokens
            self.tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            assert self.ids.setdefault(out.req_id, (out.group_id, out.sample_index)) == \
                (out.group_id, out.sample_index)
            if first or out.finished:
                assert out.num_prompt_tokens is not None and out.num_cached_tokens is not None, out
                request = self.requests.get(out.req_id)
                if request is not None:
                    assert out.num_prompt_tokens == request.num_prompt_tokens
                    assert out.num_cached_tokens == request.num_cached_tokens
            if out.finished:
                self.finished[out.req_id] = out

    def note(self, scheduler: Scheduler) -> None:
        """After adds and steps: remember the live requests (forks appear) and check that their
        records so far carried all their tokens."""
        self.requests.update(scheduler.requests)
        for request_id, request in scheduler.requests.items():
            assert self.tokens.get(request_id, []) == request.output_token_ids, request_id

    def check_all_finished(self, scheduler: Scheduler) -> None:
        for request_id, request in self.requests.items():
            out = self.finished.get(request_id)
            assert out is not None, f"{request_id!r} never got a finishing record"
            assert (out.finish_reason, out.stop_reason) == (request.finish_reason, request.stop_reason)
            assert self.tokens[request_id] == request.output_token_ids
            assert self.ids[request_id] == (request.group_id, request.sample_index)
            check_finish(request, scheduler)
        for request_id in self.tokens.keys() - self.requests.keys():
            out = self.finished.get(request_id)
            assert out is not None, f"{request_id!r} never got a finishing record"
            if len(self.tokens[request_id]) != 1:  # else forked, done at once
                # A sample never forked: its parent ended before its first token, and so did it.
                parent = self.requests[out.group_id]
                assert self.tokens[request_id] == [] and not parent.output_token_ids, request_id
                assert out.finish_reason is parent.finish_reason, request_id
        # Every group's stream completes: one finishing record per sample index it promised.
        for request in self.requests.values():
            if request.sample_index == 0:
                ended = sorted(o.sample_index for o in self.finished.values()
                               if o.group_id == request.group_id)
                assert ended == list(range(request.sampling_params.n)), (request.group_id, ended)


def check_finish(request: Request, scheduler: Scheduler) -> None:
    """The oracle of stop conditions: a finished request stopped at the first token its
    parameters call for (EOS unless ignored, a stop id — once min_tokens are out — then
    max_tokens or max_model_len), not earlier or later; an aborted one, or one that outgrew the
    whole KV cache, before any."""
    params = request.sampling_params
    outputs = request.output_token_ids
    called_for = None
    for count, token in enumerate(outputs, 1):
        assert called_for is None, f"{request.request_id!r} went on after {called_for}"
        if count >= params.min_tokens and token == request.eos_token_id and not params.ignore_eos:
            called_for = (FinishReason.STOP, None)
        elif count >= params.min_tokens and token in params.stop_token_ids:
            called_for = (FinishReason.STOP, token)
        elif count >= params.max_tokens or request.num_prompt_tokens + count >= scheduler.config.max_model_len:
            called_for = (FinishReason.LENGTH, None)
    got = (request.finish_reason, request.stop_reason)
    if called_for is not None:
        assert got == called_for, (request.request_id, got, called_for)
    elif request.finish_reason is FinishReason.LENGTH:  # it outgrew the whole cache
        assert not scheduler.kv_cache_manager.can_fit(len(request.all_token_ids)), request.request_id
    else:
        assert request.finish_reason is FinishReason.ABORT, (request.request_id, got)
