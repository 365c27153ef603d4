"""What crosses between the scheduler, the workers and the engine each step.

SchedulerOutput is a *diff*: workers keep a persistent batch and apply it. A request is sent in
full once (NewRequestData: when first scheduled, when resumed after preemption, or when forked
from a parent); after that only what changed (CachedRequestData).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from raypaged.core.request import FinishReason, Request
from raypaged.core.sampling_params import SamplingParams

# One sampled position's log-probabilities: token id -> logprob. Holds the sampled token and
# the top-k (k = SamplingParams.logprobs) tokens.
Logprobs = dict[int, float]


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt + outputs so far (outputs exist after preemption or fork)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # K/V already in the cache (prefix hit, or forked from a parent)
    eos_token_id: int | None = None  # masked with the stop ids until min_tokens are out
    # Models whose layers differ (core/kv_cache_groups.py): every KV-cache group's whole table,
    # in group order (block_ids is group 0's). None with one group.
    group_block_ids: list[list[int]] | None = None


@dataclass
class CachedRequestData:
    """Running requests the workers already hold, as parallel lists (cheap to build per step)."""

    req_ids: list[str] = field(default_factory=list)
    # all_token_ids[num_computed : num_computed + num_scheduled]: the tokens this step computes.
    # Workers write them at those positions, so their token history stays complete.
    new_token_ids: list[list[int]] = field(default_factory=list)
    # Appended to the block table. Read-only: every entry without new blocks is one shared [].
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class KVTransfers:
    """One step's copies between the GPU pool and the host tier (core/tiered_kv_cache_manager.py),
    applied by every rank to its own heads before the step's copy-on-write and forward: first
    every offload, then every load (a load may read a host block an offload of the same step
    writes, and may write a GPU block an offload of the same step reads). No host block is
    written twice, no GPU block loaded twice."""

    offloads: list[tuple[int, int]] = field(default_factory=list)  # (GPU block, host block)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host block, GPU block)
    # Whether this step's forward reads a block it loads. If not, the loads may overlap this
    # step's forward: only the next step's forward must wait for them.
    loads_read_now: bool = True

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads)


@dataclass(frozen=True)
class KVCopyTimes:
    """Seconds the host tier's copies took on a rank since its worker started (worker/
    copy_timing.py), both running totals: copy_s the side stream spent on them, exposed_s the
    compute stream stalled waiting for them (on CPU, where copies are synchronous, all of it).
    hidden_s is the rest: copy time the forward overlapped."""

    copy_s: float = 0.0
    exposed_s: float = 0.0

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.copy_s - self.exposed_s)

    def __add__(self, other: KVCopyTimes) -> KVCopyTimes:
        return KVCopyTimes(self.copy_s + other.copy_s, self.exposed_s + other.exposed_s)

    @staticmethod
    def slowest(ranks: list[KVCopyTimes]) -> KVCopyTimes:
        """Over tensor-parallel ranks: each total's max (a step waits for its slowest rank), so
        each stays monotone; the two maxima may come from different ranks."""
        return KVCopyTimes(max((r.copy_s for r in ranks), default=0.0),
                           max((r.exposed_s for r in ranks), default=0.0))


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the workers must drop before this step: finished, aborted or preempted since
    # the last step (a preempted one comes back later as a NewRequestData). Only ids the workers
    # hold. An id may also be in scheduled_new_reqs of the same output: copy-on-write replaced a
    # block in its table, so it is dropped and sent again whole (drop first, then add).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Copy-on-write: (src block, dst block) pairs to copy in every layer before the forward. No
    # dst repeats or is also a src, so one batched gather-then-scatter applies them all.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # The host tier's copies, before block_copies; None when there are none.
    kv_transfers: KVTransfers | None = None
    # Structured outputs: int32 [R, ceil(V/32)] numpy array, row i the tokens grammar_req_ids[i]
    # may sample this step (raypaged/structured/bitmask.py). None when no scheduled request has
    # a grammar: unconstrained steps carry nothing.
    grammar_bitmask: object | None = None
    grammar_req_ids: list[str] = field(default_factory=list)
    # Asynchronous scheduling: the masks of this step's constrained requests need tokens still
    # in flight (the previous step's), so the workers run its forward now and sample it when
    # the next step brings deferred_bitmask (rows: deferred_req_ids), computed once those
    # tokens are back. The next step always carries it, even a step that schedules nothing.
    grammar_deferred: bool = False
    deferred_bitmask: object | None = None
    deferred_req_ids: list[str] = field(default_factory=list)
    # Models whose layers differ: for each cached request whose table grew, every KV-cache
    # group's appended block ids, in group order (new_block_ids holds group 0's). Empty with
    # one group (core/group_tables.py fills it).
    group_new_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0 and not self.block_copies and not self.kv_transfers

    def unschedule(self, req_id: str) -> bool:
        """Take a request's entry (cached or new) back out, as when priority preemption picks
        one scheduled earlier in the step; num_scheduled_tokens is the caller's. Returns whether
        it was a cached entry (the workers still hold the request)."""
        cached = self.scheduled_cached_reqs
        if req_id in cached.req_ids:
            k = cached.req_ids.index(req_id)
            for column in (cached.req_ids, cached.new_token_ids, cached.new_block_ids,
                           cached.num_computed_tokens):
                del column[k]
            return True
        self.scheduled_new_reqs = [r for r in self.scheduled_new_reqs if r.req_id != req_id]
        return False


@dataclass
class ModelRunnerOutput:
    """Rank 0's answer to one SchedulerOutput (another rank's, when it has a host tier: only
    its kv_copy_times)."""

    req_ids: list[str] = field(default_factory=list)
    # Per request: [] for a prefill chunk that does not reach the end of its tokens; n tokens
    # when an n > 1 request finishes its prompt (one per sample, then it forks); else 1 token.
    # Lists of their own that nobody writes to afterwards: the scheduler hands a one-token list
    # on, uncopied, in the step's output record.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Per request, per sampled token (None where logprobs were not asked for).
    logprobs: list[list[Logprobs] | None] = field(default_factory=list)
    # Prompt logprobs the step scored, by request: (index of the first prompt token scored, one
    # entry per prompt token from there). Only requests that asked and computed prompt tokens.
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)
    # The host tier's copy times, running totals (None without a host tier). Every rank sends
    # its own; the executor hands on the slowest's (KVCopyTimes.slowest).
    kv_copy_times: KVCopyTimes | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one step: one record of an EngineCoreOutputs batch, as consumers
    iterate it."""

    req_id: str
    group_id: str  # the id the client knows (n > 1: shared by all samples)
    sample_index: int
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Constant per request, so sent only on the records a batch keeps whole (a request's first
    # record, its finishing one, a sample's): None on a plain next-token record.
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    error: str | None = None  # set when the engine failed the request (finish_reason ABORT)
    # Seconds from being added to being first scheduled; on the request's first output only.
    queue_time_s: float | None = None
    # SamplingParams.prompt_logprobs: on each sample's first record, one entry per prompt token
    # after the first (core/prompt_logprobs.py).
    prompt_logprobs: list[Logprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """How loaded the engine was when it handed out a batch of outputs: what a frontend sheds
    new requests by (frontend/load_shedding.py) without asking the engine per request."""

    num_waiting: int  # requests in the scheduler's waiting queue
    num_running: int
    kv_usage: float  # fraction of the KV pool's blocks held by requests


@dataclass(slots=True)
class EngineCoreOutputs:
    """Every request's news from one or more engine steps, in order, as parallel lists.

    The engine step appends a request id and a token list per decoding request instead of
    building one object per request per step (a third of the step's cost at 512 requests); the
    consumer, in its own process, expands records while it iterates.

    Record i is *plain* when it is a request's next token and nothing else: it reads as
    EngineCoreOutput(req_ids[i], req_ids[i], 0, new_token_ids[i]). Every other record (a
    request's first, a finishing or aborted one, a sample i > 0 of an n > 1 request, one with
    logprobs, an error, a queue time) is also kept whole in `records`, under its index.
    """

    req_ids: list[str] = field(default_factory=list)
    # The new tokens of record i. A plain record holds the model runner's own per-request list
    # (not copied: nothing writes to it after the step).
    new_token_ids: list[list[int]] = field(default_factory=list)
    records: dict[int, EngineCoreOutput] = field(default_factory=dict)
    # Set by the engine actor on each batch it hands out (engine/actor.py: get_outputs).
    load: EngineLoad | None = None
    # The prefix cache's events over these steps, in order (core/block_pool.py stored_event /
    # removed_event): a data-parallel frontend's router learns each engine's cached prefixes
    # from them (frontend/prefix_router.py).
    cache_events: list[int] = field(default_factory=list)

    def append(self, output: EngineCoreOutput) -> None:
        """Add a whole record (any kind)."""
        self.records[len(self.req_ids)] = output
        self.req_ids.append(output.req_id)
        self.new_token_ids.append(output.new_token_ids)

    def extend(self, other: EngineCoreOutputs) -> None:
        """Add other's records after these (e.g. the steps a consumer has not pulled yet)."""
        offset = len(self.req_ids)
        self.req_ids += other.req_ids
        self.new_token_ids += other.new_token_ids
        if other.records:
            self.records.update({offset + i: output for i, output in other.records.items()})
        if other.cache_events:
            self.cache_events += other.cache_events

    def whole_records(self) -> Iterator[EngineCoreOutput]:
        """The records kept whole: every first, last, sample and error record among them."""
        return iter(self.records.values())

    def __len__(self) -> int:
        return len(self.req_ids)

    def __iter__(self) -> Iterator[EngineCoreOutput]:
        records = self.records
        for i, (req_id, token_ids) in enumerate(zip(self.req_ids, self.new_token_ids)):
            output = records.get(i)
            yield output if output is not None else EngineCoreOutput(req_id, req_id, 0, token_ids)


def request_output(request: Request, token_ids: list[int],
                   logprobs: list[Logprobs] | None) -> EngineCoreOutput:
    """A whole record of the request's news: its new tokens, its finish if it finished, and the
    per-request counts a consumer needs with a first or last record; the prompt logprobs once
    they are complete, on the first such record."""
    record = EngineCoreOutput(request.request_id, request.group_id, request.sample_index, token_ids,
                              logprobs, request.finish_reason, request.stop_reason,
                              request.num_prompt_tokens, request.num_cached_tokens)
    if request.prompt_logprobs is not None and not request.prompt_logprobs_sent \
            and not request.prompt_logprobs_pending:
        record.prompt_logprobs = request.prompt_logprobs
        request.prompt_logprobs_sent = True
    return record


def in_scheduled_order(num_scheduled: dict[str, int], output: ModelRunnerOutput
                       ) -> tuple[list[list[int]], list[list[Logprobs] | None]]:
    """The runner's sampled tokens and logprobs in the step's scheduled order (a runner may
    answer in its own order: decodes first). ValueError if it does not answer exactly the
    scheduled requests."""
    req_ids, sampled, logprobs = output.req_ids, output.sampled_token_ids, output.logprobs
    if len(sampled) != len(req_ids) or (logprobs and len(logprobs) != len(req_ids)):
        raise ValueError("the model runner's output lists differ in length")
    if req_ids == list(num_scheduled):
        return sampled, logprobs
    if len(req_ids) != len(num_scheduled) or num_scheduled.keys() != set(req_ids):
        raise ValueError("the model runner's output does not answer the scheduled requests")
    index = {req_id: i for i, req_id in enumerate(req_ids)}
    order = [index[req_id] for req_id in num_scheduled]
    return [sampled[i] for i in order], [logprobs[i] for i in order] if logprobs else logprobs
