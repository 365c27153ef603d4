"""The engine's side of structured outputs: requests whose grammar compiles, and each step's mask.

A constrained request is held here, out of the scheduler, while its grammar compiles on the
compiler pool; the engine polls each step (never waits on a compile while anything else can run)
and queues it once compiled, or ends it with an error when the compile fails or outlives
compile_timeout_s. After each schedule(), fill_bitmask() gives the step one bitmask row per
scheduled constrained request, from that request's matcher; no row has a grammar -> no bitmask.

Under asynchronous scheduling a constrained request decodes every step with a placeholder input,
like any other: the step's mask then depends on the token the step before samples, not yet back
when the step is scheduled. Such a step is marked grammar_deferred (its forward runs at once, its
sampling waits), and the next step scheduled — after the engine has taken that token, so every
matcher is where the deferred step needs it — carries the deferred step's masks.

A resumed request (Request.resumed_output_token_ids) gets its matcher advanced over the outputs
it brings before it is queued, so its masks go on from where its first engine left off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import xgrammar as xgr

from raypaged.core.outputs import SchedulerOutput
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, Request
from raypaged.core.structured_output import StructuredOutput
from raypaged.structured.compiler import GrammarCompilerPool, check_spec
from raypaged.structured.matcher import GrammarConstraint

__all__ = ["StructuredOutputManager"]


@dataclass
class _Compiling:
    request: Request
    future: Future[xgr.CompiledGrammar]
    deadline: float


class StructuredOutputManager:
    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...],
                 compile_timeout_s: float) -> None:
        self._compilers = GrammarCompilerPool(tokenizer_dir, vocab_size, stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self._compiling: dict[str, _Compiling] = {}  # request id -> its compile, in arrival order
        # Group ids of queued constrained requests; emptied as their groups end (is_live).
        self._live_groups: set[str] = set()
        # The last step's constrained request ids when its masks were deferred to this step.
        self._deferred: list[str] | None = None

    # ---- on the way in ---------------------------------------------------------------------------
    @staticmethod
    def validate(spec: StructuredOutput) -> None:
        """InvalidRequestError if the grammar engine rejects the spec (before queueing)."""
        check_spec(spec)

    def add(self, request: Request) -> None:
        spec = request.sampling_params.structured_output
        assert spec is not None
        future = self._compilers.compile(spec)
        self._compiling[request.request_id] = _Compiling(
            request, future, time.monotonic() + self.compile_timeout_s)

    def compiled(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The spec's compiled grammar, waiting for it (tests and tools; never the step loop)."""
        return self._compilers.compile(spec).result()

    def holds(self, request_id: str) -> bool:
        return request_id in self._compiling

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def abort(self, group_or_request_id: str) -> Request | None:
        """Forget a request still compiling (its id or group id); returns it, or None."""
        entry = self._compiling.pop(group_or_request_id, None)
        return entry.request if entry is not None else None

    def wait(self, timeout_s: float) -> None:
        """Block up to timeout_s for a compile to finish (only when nothing else can run)."""
        if self._compiling:
            wait([e.future for e in self._compiling.values()], timeout_s, FIRST_COMPLETED)

    def poll(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests whose grammar is ready, each with its Constraint set, in arrival order;
        (request, error) for those whose compile failed or timed out)."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        now = time.monotonic()
        for request_id, entry in list(self._compiling.items()):
            future = entry.future
            if future.done():
                del self._compiling[request_id]
                error = future.exception()
                if error is not None:
                    failed.append((entry.request, f"structured output grammar failed to compile: {error}"))
                    continue
                spec = entry.request.sampling_params.structured_output
                assert spec is not None
                constraint = GrammarConstraint(future.result(), reasoning_end=spec.reasoning_end_token_ids)
                if not all(constraint.accept(t) for t in entry.request.resumed_output_token_ids):
                    failed.append((entry.request, "the resumed outputs do not match the structured "
                                                  "output grammar"))
                    continue
                entry.request.constraint = constraint
                self._live_groups.add(entry.request.group_id)
                ready.append(entry.request)
            elif now > entry.deadline:
                del self._compiling[request_id]
                failed.append((entry.request, "structured output grammar did not compile within "
                                              f"{self.compile_timeout_s:g} s"))
        return ready, failed

    # ---- each step -------------------------------------------------------------------------------
    def fill_bitmask(self, out: SchedulerOutput, requests: dict[str, Request],
                     is_live: Callable[[str], bool]) -> None:
        """Set the step's masks: out.grammar_bitmask / grammar_req_ids for its constrained
        requests, or grammar_deferred when one's input token is still in flight; and
        out.deferred_bitmask / deferred_req_ids when the previous step was deferred."""
        if self._deferred is not None:
            ids, self._deferred = self._deferred, None
            out.deferred_bitmask = self._masks([(i, _constraint_of(requests.get(i))) for i in ids])
            out.deferred_req_ids = ids
        if not self._live_groups:
            return  # the usual case: nothing constrained, nothing to look at
        self._live_groups = {g for g in self._live_groups if is_live(g)}
        constrained: list[tuple[str, GrammarConstraint | None]] = []
        deferred = False
        for request_id in out.num_scheduled_tokens:
            request = requests.get(request_id)
            constraint = _constraint_of(request)
            if constraint is not None:
                assert request is not None
                constrained.append((request_id, constraint))
                # The step's last input is the token it samples after: still a placeholder?
                deferred = deferred or (
                    request.all_token_ids[request.num_computed_tokens - 1] == PLACEHOLDER_TOKEN_ID)
        if not constrained:
            return
        out.grammar_req_ids = [request_id for request_id, _ in constrained]
        if deferred:
            out.grammar_deferred = True
            self._deferred = out.grammar_req_ids
        else:
            out.grammar_bitmask = self._masks(constrained)

    def _masks(self, rows: list[tuple[str, GrammarConstraint | None]]) -> object:
        """One row per request, from its matcher as it is now; a request gone meanwhile (its
        token will be dropped) gets a row allowing everything."""
        bitmask = xgr.allocate_token_bitmask(len(rows), self._compilers.vocab_size)
        # One row at a time: xgrammar's threaded BatchGrammarMatcher was over ten times slower
        # at 32 rows on the H200's host (benchmarks/README.md).
        for row, (_, constraint) in enumerate(rows):
            if constraint is not None:
                constraint.fill(bitmask, row)
        return bitmask.numpy()

    def reset_workers(self) -> None:
        """The workers were replaced: the step whose masks were deferred died with them."""
        self._deferred = None

    def shutdown(self) -> None:
        self._compilers.shutdown()


def _constraint_of(request: Request | None) -> GrammarConstraint | None:
    if request is None or not isinstance(request.constraint, GrammarConstraint):
        return None
    return request.constraint
