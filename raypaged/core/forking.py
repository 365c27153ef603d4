"""Forking an n > 1 request into its samples, once its prompt is done.

The step that completes the group's prompt samples n tokens: the parent keeps token 0, samples
1..n-1 become requests of their own (parallel_sampling.py builds them) sharing the parent's
blocks through the KV manager's fork. Where each runs is decided here: in running beside the
parent while max_num_seqs and the KV cache allow, otherwise waiting, to recompute.
"""

from __future__ import annotations

from raypaged.core.errors import NoFreeBlocksError
from raypaged.core.outputs import EngineCoreOutputs, Logprobs, request_output
from raypaged.core.parallel_sampling import new_sample
from raypaged.core.request import Request, RequestStatus
from raypaged.core.scheduler_state import SchedulerState

__all__ = ["Forking"]

_RUNNING = RequestStatus.RUNNING


class Forking(SchedulerState):
    """The scheduler's part that forks n > 1 requests (_fork)."""

    def _fork(self, parent: Request, sampled: list[int], logprobs: list[Logprobs] | None,
              outputs: EngineCoreOutputs) -> None:
        """The group's prompt is done and the worker sampled one token per sample: the parent
        keeps token 0, samples 1..n-1 become requests of their own sharing its blocks. They go
        just before the parent in running, so they are scheduled (and copy the shared partial
        block) first and the parent usually writes into it in place. Samples beyond
        max_num_seqs, or that a copying manager has no room for, wait and recompute."""
        n = parent.sampling_params.n
        if len(sampled) != n:
            raise ValueError(f"request {parent.request_id!r} with n={n} got {len(sampled)} samples")
        kv = self.kv_cache_manager
        forked: list[Request] = []
        for i in range(1, n):
            child = new_sample(parent, i, sampled[i], self.config.max_model_len)
            # A dead end on its first token ends it without the token (parallel_sampling.py).
            first = [sampled[i]] if child.num_output_tokens else []
            outputs.append(request_output(child, first, [logprobs[i]] if logprobs and first else None))
            if child.status is RequestStatus.FINISHED:
                continue
            self.requests[child.request_id] = child
            self._groups[parent.group_id].add(child.request_id)
            if len(self.running) + len(forked) < self.config.max_num_seqs:
                child.num_computed_tokens = parent.num_computed_tokens
                try:
                    kv.fork(parent, child)
                except NoFreeBlocksError:
                    child.num_computed_tokens = 0
                else:
                    child.status = _RUNNING
                    self._num_slots[child.request_id] = -1
                    forked.append(child)
                    continue
            self.waiting.add_preempted(child)
        if forked:
            self._num_slots[parent.request_id] = -1  # its last block may now be shared
            at = self.running.index(parent)
            self.running[at:at] = forked

