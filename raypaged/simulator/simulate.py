"""Replay a trace through the real Scheduler with a paged or a contiguous KV manager, and measure
where the KV memory goes at every step.

Every step, as its forward pass sees the pool (after schedule(), before the sampled tokens come
back), the pool splits into:
- token states: slots holding a token's K/V, or being written with it by this step (shared
  prefix blocks counted once);
- reserved: allocated, unfilled slots the request will still fill before it finishes;
- never used: allocated slots beyond the request's final length (over-reservation, or the
  unused tail of a paged request's last block);
- external fragmentation: free blocks that no contiguous run the next waiting request needs
  can use (zero for the paged pool: any free block serves any request);
- free: the rest.
"internal fragmentation" below is reserved + never used (allocated but unfilled), as a share
of the pool. Averages are over time (ratio of sums over steps), over all steps and over the
*saturated* steps — those where some request is still waiting, i.e. memory is what limits.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from raypaged.core.contiguous_kv_cache_manager import ContiguousKVCacheManager
from raypaged.core.kv_cache_manager import KVCacheManager
from raypaged.core.request import Request
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from raypaged.simulator.fake_runner import FakeModelRunner
from raypaged.simulator.traces import Trace

# Allocator name -> the contiguous reservation policy it uses (None: the paged manager).
ALLOCATORS: dict[str, str | None] = {
    "paged": None,
    "contiguous": "max_model_len",
    "contiguous-pow2": "pow2",
    "contiguous-oracle": "oracle",
}
BREAKDOWN = ("token_states", "reserved", "never_used", "external_fragmentation", "free")


@dataclass(frozen=True)
class SimConfig:
    num_blocks: int = 1000
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048


@dataclass
class StepSample:
    step: int
    running: int
    waiting: bool  # some arrived request is waiting (for its first schedule or after preemption)
    slots: dict[str, int]  # BREAKDOWN category -> slots


@dataclass
class SimResult:
    trace: str
    allocator: str
    pool_slots: int
    samples: list[StepSample] = field(default_factory=list)
    steps_to_drain: int = 0  # the clock when the last request finished (idle gaps included)
    engine_steps: int = 0  # steps that scheduled work
    preemptions: int = 0
    output_tokens: int = 0
    max_unfilled_per_request: int = 0  # the largest allocated-but-unfilled slots any request held
    peak_shared_saved_slots: int = 0
    mean_shared_saved_slots: float = 0.0
    prefix_cache_hit_tokens: int = 0
    pool_whole_at_end: bool = False

    def _ratio(self, num: Callable[[StepSample], float], den: Callable[[StepSample], float],
               saturated: bool) -> float:
        chosen = [s for s in self.samples if s.waiting] if saturated else self.samples
        if saturated and not chosen:  # never memory-bound (light load): fall back to every step
            chosen = self.samples
        total = sum(den(s) for s in chosen)
        return sum(num(s) for s in chosen) / total if total else 0.0

    def kv_utilization(self, saturated: bool = False) -> float:
        """Filled / allocated slots: of the memory handed out, the share holding token states."""
        def allocated(s: StepSample) -> float:
            return s.slots["token_states"] + s.slots["reserved"] + s.slots["never_used"]

        return self._ratio(lambda s: s.slots["token_states"], allocated, saturated)

    def pool_share(self, category: str, saturated: bool = False) -> float:
        """Share of the whole pool in one BREAKDOWN category (the vLLM paper's fig. 2 measure)."""
        return self._ratio(lambda s: s.slots[category], lambda s: self.pool_slots, saturated)

    def internal_fragmentation(self, saturated: bool = False) -> float:
        def unfilled(s: StepSample) -> float:
            return s.slots["reserved"] + s.slots["never_used"]

        return self._ratio(unfilled, lambda s: self.pool_slots, saturated)

    @property
    def peak_running(self) -> int:
        return max((s.running for s in self.samples), default=0)

    def mean_running(self, saturated: bool = False) -> float:
        return self._ratio(lambda s: s.running, lambda s: 1, saturated)

    def averages(self, saturated: bool) -> dict[str, float]:
        return {
            "kv_utilization": self.kv_utilization(saturated),
            "internal_fragmentation": self.internal_fragmentation(saturated),
            "external_fragmentation": self.pool_share("external_fragmentation", saturated),
            "mean_running": self.mean_running(saturated),
            **{f"pool_{c}": self.pool_share(c, saturated) for c in BREAKDOWN},
        }

    def summary(self) -> dict:
        sat, overall = self.averages(saturated=True), self.averages(saturated=False)
        return {
            "trace": self.trace, "allocator": self.allocator, "pool_slots": self.pool_slots,
            "saturated": {k: round(v, 4) for k, v in sat.items()},
            "overall": {k: round(v, 4) for k, v in overall.items()},
            "saturated_steps": sum(s.waiting for s in self.samples),
            "peak_running": self.peak_running, "steps_to_drain": self.steps_to_drain,
            "engine_steps": self.engine_steps, "preemptions": self.preemptions,
            "output_tokens": self.output_tokens,
            "max_unfilled_per_request": self.max_unfilled_per_request,
            "peak_shared_saved_slots": self.peak_shared_saved_slots,
            "mean_shared_saved_slots": round(self.mean_shared_saved_slots, 1),
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "pool_whole_at_end": self.pool_whole_at_end,
        }


def make_manager(allocator: str, config: SimConfig) -> KVCacheManager | ContiguousKVCacheManager:
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator!r}; choose from {', '.join(ALLOCATORS)}")
    policy = ALLOCATORS[allocator]
    if policy is None:
        return KVCacheManager(config.num_blocks, config.block_size, enable_prefix_caching=True)
    return ContiguousKVCacheManager(config.num_blocks, config.block_size, config.max_model_len,
                                    reservation=policy)


def simulate(trace: Trace, allocator: str, config: SimConfig = SimConfig(),
             on_step: Callable[[], None] | None = None) -> SimResult:
    """Run `trace` to completion; `on_step` is called once per engine step (a progress bar)."""
    if trace.max_model_len > config.max_model_len:
        raise ValueError(f"trace {trace.name!r} was made for max_model_len={trace.max_model_len} "
                         f"> the simulator's {config.max_model_len}")
    manager = make_manager(allocator, config)
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=config.num_blocks, block_size=config.block_size,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len, enable_prefix_caching=allocator == "paged",
    ), kv_cache_manager=manager)
    runner = FakeModelRunner()
    result = SimResult(trace.name, allocator, pool_slots=config.num_blocks * config.block_size)

    arrivals = collections.deque(sorted(trace.requests, key=lambda r: r.arrival_step))
    expected = {r.request_id: r.output_len for r in trace.requests}
    requests: dict[str, Request] = {}
    not_yet_scheduled: collections.deque[Request] = collections.deque()  # in arrival order
    scheduled_once: set[str] = set()
    generated: collections.Counter[str] = collections.Counter()
    shared_saved_sum = 0
    # A livelock guard far above any real drain time: every token is computed at least once per
    # step, so steps <= tokens x (1 + preemptions); allow generous slack for idle arrival gaps.
    max_steps = 50 * sum(r.total_len for r in trace.requests) + 10 * trace.requests[-1].arrival_step
    step = 0
    while arrivals or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests() and arrivals[0].arrival_step > step:
            step = arrivals[0].arrival_step  # idle until the next arrival
        while arrivals and arrivals[0].arrival_step <= step:
            request = arrivals.popleft().to_request()
            scheduler.add_request(request)
            requests[request.request_id] = request
            not_yet_scheduled.append(request)

        scheduler_output = scheduler.schedule()
        scheduled_once.update(new.req_id for new in scheduler_output.scheduled_new_reqs)
        while not_yet_scheduled and not_yet_scheduled[0].request_id in scheduled_once:
            not_yet_scheduled.popleft()
        # Measured as the forward pass sees the pool: blocks for this step handed out, requests
        # that did not fit still waiting.
        next_request = not_yet_scheduled[0] if not_yet_scheduled else None
        sample, max_unfilled, shared_saved = _measure(
            manager, requests, scheduler_output.num_scheduled_tokens, next_request, config, step,
            waiting=scheduler.num_waiting > 0)
        outputs = scheduler.update_from_output(scheduler_output, runner.execute(scheduler_output))
        for req_id, new_token_ids in zip(outputs.req_ids, outputs.new_token_ids):
            generated[req_id] += len(new_token_ids)
        result.preemptions += len(scheduler_output.preempted_req_ids)
        result.engine_steps += scheduler_output.total_num_scheduled_tokens > 0
        result.samples.append(sample)
        result.max_unfilled_per_request = max(result.max_unfilled_per_request, max_unfilled)
        result.peak_shared_saved_slots = max(result.peak_shared_saved_slots, shared_saved)
        shared_saved_sum += shared_saved
        step += 1
        if on_step is not None:
            on_step()
        if step > max_steps:
            raise RuntimeError(f"{allocator} on {trace.name}: no progress after {step} steps")

    stats = manager.stats()
    result.steps_to_drain = step
    result.output_tokens = sum(generated.values())
    result.mean_shared_saved_slots = shared_saved_sum / max(1, len(result.samples))
    result.prefix_cache_hit_tokens = stats.prefix_cache_hits
    result.pool_whole_at_end = stats.num_free_blocks == config.num_blocks
    wrong = {rid: (generated[rid], n) for rid, n in expected.items() if generated[rid] != n}
    if wrong:
        raise RuntimeError(f"{allocator} on {trace.name}: requests generated the wrong number of "
                           f"tokens (got, expected): {dict(list(wrong.items())[:5])}")
    return result


def _measure(manager, requests: dict[str, Request], num_scheduled: dict[str, int],
             next_request: Request | None, config: SimConfig, step: int,
             waiting: bool) -> tuple[StepSample, int, int]:
    """The pool during one step's forward. Slots this step writes count as filled (token
    states): the step is what fills them."""
    stats = manager.stats()
    bs = config.block_size
    in_flight = sum(num_scheduled.values())
    allocated, filled = stats.allocated_slots, stats.filled_slots + in_flight
    never_used = max_unfilled = 0
    for request_id, num_new in num_scheduled.items():
        request = requests[request_id]
        held = len(manager.get_block_ids(request_id)) * bs
        # The last sampled token's K/V is never computed, so a request finally fills
        # prompt + max_tokens - 1 slots.
        final = request.num_prompt_tokens + request.sampling_params.max_tokens - 1
        never_used += max(0, held - final)
        max_unfilled = max(max_unfilled, held - request.num_computed_tokens - num_new)
    if isinstance(manager, ContiguousKVCacheManager):
        need = None if next_request is None else manager.reservation_blocks(next_request)
        external = manager.unusable_free_blocks(need) * bs if need is not None else 0
    else:
        external = 0  # paged: every free block can serve every request
    slots = {
        "token_states": filled,
        "reserved": allocated - filled - never_used,
        "never_used": never_used,
        "external_fragmentation": external,
        "free": stats.num_free_blocks * bs - external,
    }
    sample = StepSample(step, len(num_scheduled), waiting, slots)
    return sample, max_unfilled, stats.shared_saved_slots
