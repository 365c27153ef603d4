"""A request's state as the scheduler sees it: tokens, progress, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from raypaged.core.sampling_params import SamplingParams
from raypaged.core.structured_output import Constraint

# Asynchronous scheduling: the scheduler plans step N+1 before step N's sampled tokens are back.
# A request that step N samples for gets this id appended in their place; step N+1 sends it as
# the request's next input, and the worker substitutes the token it sampled (kept on the device).
PLACEHOLDER_TOKEN_ID = -1


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id (or a stop string, decided by the frontend)
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the client, the frontend or an error


# The stop_reason of the records of requests an engine ended because it gave up on its workers
# (their error says why): the request was not at fault, and a frontend may run it again on
# another engine (frontend/replay.py).
ENGINE_FAILED = "engine_failed"


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again, its KV freed; it recomputes prompt + outputs
    FINISHED = enum.auto()


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower is more important, as in vLLM; ties broken by arrival
    cache_salt: str | None = None  # isolates prefix-cache entries between tenants
    # n > 1: the prompt is prefilled once, then forked. Every sample of a group shares
    # group_id (the id the client knows); sample i > 0 has request_id "group_id#i"
    # (core/sample_ids.py).
    group_id: str = ""
    sample_index: int = 0
    # A request resumed on a new engine after the one running it died (frontend/replay.py):
    # the output tokens its client already has, after the prompt in all_token_ids from the
    # start. The engine takes it as it would a preempted request: it recomputes prompt +
    # outputs and goes on, so max_tokens, min_tokens, penalties and the seeded sampler's
    # positions all count these outputs, and a grammar's matcher is advanced over them.
    resumed_output_token_ids: tuple[int, ...] = ()

    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at first schedule
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id (or string) that ended it
    # Prompt then outputs: the one list a step appends to (outputs are its tail, see
    # output_token_ids), so the per-request hot path touches one list, not two.
    all_token_ids: list[int] = field(init=False)
    # Set by the scheduler when it takes the request (core/stop_checks.py), so that its per-step
    # stop check is two comparisons: the token ids that may stop it, and the number of tokens at
    # which it stops for length. Until then they send every token through the full check.
    stop_token_set: frozenset[int] = field(init=False, default=frozenset(), repr=False)
    max_num_tokens: int = field(init=False, default=0, repr=False)
    # Its next output record must be kept whole (see EngineCoreOutputs): until its first token,
    # and for good for a sample i > 0 or a request that asked for logprobs.
    whole_records: bool = field(init=False, default=True, repr=False)
    # Structured output: its grammar state, set by the engine once the grammar compiled. Its
    # records are always kept whole (the scheduler advances it with each token).
    constraint: Constraint | None = field(init=False, default=None, repr=False)
    # SamplingParams.prompt_logprobs: one entry per prompt token after the first, gathered as
    # the prefill chunks are answered (core/prompt_logprobs.py); None when not asked for.
    prompt_logprobs: list[dict[int, float]] | None = field(init=False, default=None, repr=False)
    prompt_logprobs_sent: bool = field(init=False, default=False, repr=False)

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.resumed_output_token_ids = tuple(self.resumed_output_token_ids)
        self.all_token_ids = self.prompt_token_ids + list(self.resumed_output_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def prompt_logprobs_pending(self) -> bool:
        """It asked for prompt logprobs and some prompt position is not scored yet: it must
        compute every prompt token (no prefix-cache hit)."""
        scored = self.prompt_logprobs
        return scored is not None and len(scored) < len(self.prompt_token_ids) - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, not counting a placeholder of one still being sampled."""
        tokens = self.all_token_ids
        count = len(tokens) - len(self.prompt_token_ids)
        while count and tokens[len(self.prompt_token_ids) + count - 1] == PLACEHOLDER_TOKEN_ID:
            count -= 1
        return count

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy: append through append_output_token), without the
        placeholder of a token still being sampled."""
        outputs = self.all_token_ids[len(self.prompt_token_ids):]
        while outputs and outputs[-1] == PLACEHOLDER_TOKEN_ID:
            outputs.pop()
        return outputs

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
