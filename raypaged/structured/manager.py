"""The engine's side of structured outputs: requests whose grammar compiles, and each step's mask.

A constrained request is held here, out of the scheduler, while its grammar compiles on the
compiler pool; the engine polls each step (never waits on a compile while anything else can run)
and queues it once compiled, or ends it with an error when the compile fails or outlives
compile_timeout_s. After each schedule(), fill_bitmask() gives the step one bitmask row per
scheduled constrained request, from that request's matcher; no row has a grammar -> no bitmask.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import xgrammar as xgr

from raypaged.core.outputs import SchedulerOutput
from raypaged.core.request import Request
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
                entry.request.constraint = GrammarConstraint(future.result())
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
        """Set out.grammar_bitmask / grammar_req_ids for the step's constrained requests."""
        if not self._live_groups:
            return  # the usual case: nothing constrained, nothing to look at
        self._live_groups = {g for g in self._live_groups if is_live(g)}
        constrained: list[tuple[str, GrammarConstraint]] = []
        for request_id in out.num_scheduled_tokens:
            request = requests.get(request_id)
            if request is not None and isinstance(request.constraint, GrammarConstraint):
                constrained.append((request_id, request.constraint))
        if not constrained:
            return
        bitmask = xgr.allocate_token_bitmask(len(constrained), self._compilers.vocab_size)
        for row, (_, constraint) in enumerate(constrained):
            constraint.fill(bitmask, row)
        out.grammar_bitmask = bitmask.numpy()
        out.grammar_req_ids = [request_id for request_id, _ in constrained]

    def shutdown(self) -> None:
        self._compilers.shutdown()
