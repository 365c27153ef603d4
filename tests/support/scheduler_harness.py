"""A Scheduler stepped by hand against a ShadowWorker (tests/support/core_fakes.py) whose sampled
tokens are scripted per request, with every invariant recomputed after each step: what the
scheduler's own tests (tests/core/test_scheduler.py, test_preemption.py,
test_parallel_sampling.py) drive it through."""

from __future__ import annotations

from collections import defaultdict

from raypaged.core.scheduler import Scheduler, SchedulerConfig
from tests.support.core_fakes import ShadowWorker, check_invariants, check_pool_whole, make_request

EOS = 0


class Harness:
    """A scheduler and a shadow worker whose sampled tokens are scripted per request
    (default 7, never EOS)."""

    def __init__(self, **config):
        config.setdefault("block_size", 4)
        config.setdefault("num_blocks", 64)
        config.setdefault("max_model_len", 64)
        self.scheduler = Scheduler(SchedulerConfig(**config))
        self.script: dict[str, list[int]] = defaultdict(list)
        self.worker = ShadowWorker(config["num_blocks"], config["block_size"], self._sample)

    def _sample(self, req_id: str, position: int = 0) -> int:
        return self.script[req_id].pop(0) if self.script[req_id] else 7

    def add(self, request_id, prompt, **params):
        params.setdefault("eos", EOS)
        request = make_request(request_id, prompt, **params)
        self.scheduler.add_request(request)
        return request

    def step(self):
        out = self.scheduler.schedule()
        outputs = self.scheduler.update_from_output(out, self.worker.execute(out))
        check_invariants(self.scheduler, self.worker)
        return out, {o.req_id: o for o in outputs}

    def drain(self, max_steps=500):
        finished = {}
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            _, outputs = self.step()
            finished.update({rid: o for rid, o in outputs.items() if o.finished})
        check_pool_whole(self.scheduler)
        return finished
