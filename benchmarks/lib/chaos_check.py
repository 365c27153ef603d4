"""The verdict of a chaos soak: each call of the chaos run against the same call in the
fault-free reference run (benchmarks/lib/chaos_plan.py says why they must agree).

- completed: every sample's tokens (gRPC), text and finish reason equal the reference's;
- cancelled or past its deadline: every sample's tokens and text are a prefix of the reference's
  (what was streamed before leaving is right, nothing doubled, nothing skipped);
- lost: hung, or a well-formed call that failed (`error`);
- a malformed call served, or refused with another status than INVALID_ARGUMENT / 400: counted
  apart (`malformed_misanswered`).

A mismatch is `duplicated` when the call streamed more than the reference at that point (a
token repeated), `missing` when less (a gap), `changed` when as many but others."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict

from benchmarks.lib.chaos_plan import CANCELLED, COMPLETED, DEADLINE, ERROR, HUNG, CallResult, PlannedCall


def _mismatch(got: list, want: list, whole: bool) -> str | None:
    """How `got` differs from `want` (equal when whole, a prefix otherwise), or None."""
    if got == (want if whole else want[: len(got)]):
        return None
    at = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    if at == len(want) or (at > 0 and got[at] == want[at - 1]):
        return "duplicated"  # more than the reference, or the one before again
    if at == len(got) or (at + 1 < len(want) and got[at] == want[at + 1]):
        return "missing"  # less than the reference, or the one after already
    return "changed"


def check_call(call: PlannedCall, got: CallResult, want: CallResult) -> str | None:
    """The kind of mismatch of one well-formed call, or None when it agrees."""
    if got.outcome not in (COMPLETED, CANCELLED, DEADLINE):
        return None
    whole = got.outcome == COMPLETED
    sequences: list[tuple[list, list]] = [(list(g), list(w)) for g, w in zip(got.text, want.text)]
    if call.door == "grpc":
        sequences = [(g, w) for g, w in zip(got.tokens, want.tokens)] + sequences
    for g, w in sequences:
        kind = _mismatch(g, w, whole)
        if kind is not None:
            return kind
    if whole and got.finish != want.finish:
        return "changed"
    return None


def verdict(plan: list[PlannedCall], chaos: list[CallResult], reference: dict[int, CallResult]) -> dict:
    outcomes = Counter(r.outcome for r in chaos)
    mismatches: Counter = Counter()
    examples: list[dict] = []
    lost: list[dict] = []
    misanswered: list[dict] = []
    reference_failed: list[dict] = []
    by_index = {r.index: r for r in chaos}
    for call in plan:
        got = by_index[call.index]
        if call.malformed:
            if got.outcome != "refused":
                misanswered.append({"index": call.index, "kind": call.kind, "outcome": got.outcome,
                                    "detail": got.detail})
            continue
        if got.outcome in (HUNG, ERROR):
            lost.append({"index": call.index, "door": call.door, "outcome": got.outcome, "detail": got.detail})
            continue
        want = reference[call.index]
        if want.outcome != COMPLETED:
            reference_failed.append({"index": call.index, "outcome": want.outcome, "detail": want.detail})
            continue
        kind = check_call(call, got, want)
        if kind is not None:
            mismatches[kind] += 1
            if len(examples) < 5:
                examples.append({"call": asdict(call), "got": asdict(got), "want": asdict(want), "kind": kind})
    return {
        "calls": len(chaos), "outcomes": dict(outcomes),
        "completed": outcomes[COMPLETED], "cancelled": outcomes[CANCELLED],
        "deadline_exceeded": outcomes[DEADLINE], "refused": outcomes["refused"],
        "lost": len(lost), "lost_examples": lost[:10],
        "mismatches": sum(mismatches.values()), "mismatch_kinds": dict(mismatches),
        "mismatch_examples": examples,
        "malformed": sum(c.malformed for c in plan),
        "malformed_misanswered": len(misanswered), "malformed_misanswered_examples": misanswered[:10],
        "reference_failed": len(reference_failed), "reference_failed_examples": reference_failed[:10],
        "tokens_streamed": sum(r.num_tokens for r in chaos),
    }
