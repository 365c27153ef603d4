"""What crosses between the scheduler, the workers and the engine each step.

SchedulerOutput is a *diff*: workers keep a persistent batch and apply it. A request is sent in
full once (NewRequestData: when first scheduled, when resumed after preemption, or when forked
from a parent); after that only what changed (CachedRequestData).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raypaged.core.request import FinishReason
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


@dataclass
class CachedRequestData:
    """Running requests the workers already hold, as parallel lists (cheap to build per step)."""

    req_ids: list[str] = field(default_factory=list)
    # all_token_ids[num_computed : num_computed + num_scheduled]: the tokens this step computes.
    # Workers write them at those positions, so their token history stays complete.
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to the block table
    num_computed_tokens: list[int] = field(default_factory=list)


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

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0 and not self.block_copies


@dataclass
class ModelRunnerOutput:
    """Rank 0's answer to one SchedulerOutput."""

    req_ids: list[str] = field(default_factory=list)
    # Per request: [] for a prefill chunk that does not reach the end of its tokens; n tokens
    # when an n > 1 request finishes its prompt (one per sample, then it forks); else 1 token.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Per request, per sampled token (None where logprobs were not asked for).
    logprobs: list[list[Logprobs] | None] = field(default_factory=list)


@dataclass(slots=True)  # built for every running request every step: slots make that cheaper
class EngineCoreOutput:
    """One request's news from one step, batched with all others for the frontend."""

    req_id: str
    group_id: str  # the id the client knows (n > 1: shared by all samples)
    sample_index: int
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when the engine failed the request (finish_reason ABORT)
    # Seconds from being added to being first scheduled; on the request's first output only.
    queue_time_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
