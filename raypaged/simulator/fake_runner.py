"""A model runner that computes nothing: it applies each SchedulerOutput diff the way a worker
does and answers with deterministic token ids, so the simulator exercises the real Scheduler
without torch.

It keeps only what a worker must know to decide whether a request samples this step: the
request's token count. A prefill chunk that stops short of the last token samples nothing; any
step that reaches it samples one token.
"""

from __future__ import annotations

from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput

FAKE_VOCAB_SIZE = 32000


def fake_token_id(request_id: str, position: int) -> int:
    """A token that depends only on (request, position): reruns and resumptions agree. Never 0,
    the traces' EOS id (traces also set ignore_eos)."""
    return 1 + (sum(map(ord, request_id)) * 7919 + position * 104729) % (FAKE_VOCAB_SIZE - 1)


class FakeModelRunner:
    def __init__(self) -> None:
        self._num_tokens: dict[str, int] = {}  # request id -> tokens known to the "worker"

    @property
    def num_requests(self) -> int:
        return len(self._num_tokens)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self._num_tokens.pop(req_id, None)
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            if new.sampling_params.n != 1:
                raise ValueError("the simulator's traces are n=1: its fake runner samples one token per request")
            self._num_tokens[new.req_id] = len(new.token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            if req_id not in self._num_tokens:
                raise RuntimeError(f"scheduler sent cached request {req_id!r} the runner never received")
            computed[req_id] = num_computed

        output = ModelRunnerOutput()
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            num_tokens = self._num_tokens[req_id]
            reached = computed[req_id] + num_scheduled
            if reached > num_tokens:
                raise RuntimeError(f"{req_id!r}: scheduled past its last token ({reached} > {num_tokens})")
            sampled = [fake_token_id(req_id, num_tokens)] if reached == num_tokens else []
            self._num_tokens[req_id] += len(sampled)
            output.req_ids.append(req_id)
            output.sampled_token_ids.append(sampled)
            output.logprobs.append(None)
        return output
