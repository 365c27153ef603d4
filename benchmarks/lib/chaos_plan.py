"""What a chaos soak sends (benchmarks/chaos.py): a seeded plan of calls over gRPC and OpenAI
HTTP, and what each one came to.

Every well-formed call is deterministic given its plan — greedy, or sampled with a seed (the
sampler's draws depend only on (seed, position), never on the batch or on a fault) — so a
fault-free reference run of the same calls, whole (no cancel, no deadline), says exactly which
tokens each must stream. Malformed calls (bytes that are no message, JSON that does not parse,
parameters out of range) must be refused with INVALID_ARGUMENT / HTTP 400 and change nothing."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

GREEDY, SEEDED = "greedy", "seeded"
BAD_PROTO, BAD_JSON, BAD_PARAMS = "bad_proto", "bad_json", "bad_params"
MALFORMED = (BAD_PROTO, BAD_JSON, BAD_PARAMS)

# How a call ended. lost: it never ended (hung) or a well-formed call failed (an error status
# that is neither its own deadline nor load shedding); refused: a malformed call refused as it
# should be, or a call shed under load (RESOURCE_EXHAUSTED / 429), which a client may retry.
COMPLETED, CANCELLED, DEADLINE, REFUSED = "completed", "cancelled", "deadline_exceeded", "refused"
ERROR, HUNG = "error", "hung"


@dataclass(frozen=True)
class ChaosMix:
    """The share of each kind of call; the rest of the well-formed ones are greedy."""

    http_fraction: float = 0.35
    seeded_fraction: float = 0.4
    n2_fraction: float = 0.1  # seeded gRPC calls with n = 2
    cancel_fraction: float = 0.2  # left by the client after a random number of messages
    deadline_fraction: float = 0.1  # sent with a deadline, often too short to finish
    malformed_fraction: float = 0.06
    max_prompt_tokens: int = 48
    max_new_tokens: int = 40


@dataclass(frozen=True)
class PlannedCall:
    index: int
    door: str  # grpc | http
    kind: str  # greedy | seeded | bad_proto | bad_json | bad_params
    prompt_token_ids: list[int]
    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    cancel_after_chunks: int | None = None
    deadline_s: float | None = None

    @property
    def malformed(self) -> bool:
        return self.kind in MALFORMED

    def whole(self) -> PlannedCall:
        """The call as the reference run sends it: no cancel, no deadline."""
        return dataclasses.replace(self, cancel_after_chunks=None, deadline_s=None)


@dataclass
class CallResult:
    """What one call came to. tokens: each sample's token ids (gRPC; HTTP streams text only);
    text: each sample's text; finish: each sample's finish reason."""

    index: int
    outcome: str
    seconds: float
    tokens: list[list[int]] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    detail: str = ""

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def plan_calls(num_calls: int, mix: ChaosMix, vocab_size: int, max_model_len: int,
               seed: int = 0) -> list[PlannedCall]:
    """`num_calls` calls, the same for the same arguments."""
    rng = random.Random(seed)
    plan = []
    for i in range(num_calls):
        prompt_len = rng.randint(1, min(mix.max_prompt_tokens, max_model_len // 2))
        max_tokens = rng.randint(1, min(mix.max_new_tokens, max_model_len - prompt_len))
        door = "http" if rng.random() < mix.http_fraction else "grpc"
        prompt = [rng.randrange(3, vocab_size) for _ in range(prompt_len)]
        if rng.random() < mix.malformed_fraction:
            kind = rng.choice([BAD_PROTO if door == "grpc" else BAD_JSON, BAD_PARAMS])
            plan.append(PlannedCall(i, door, kind, prompt, max_tokens))
            continue
        seeded = rng.random() < mix.seeded_fraction
        n = 2 if seeded and door == "grpc" and rng.random() < mix.n2_fraction else 1
        cancel = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < mix.cancel_fraction else None
        deadline = rng.uniform(0.05, 2.0) if rng.random() < mix.deadline_fraction else None
        plan.append(PlannedCall(
            i, door, SEEDED if seeded else GREEDY, prompt, max_tokens, n=n,
            temperature=rng.choice([0.7, 1.0]) if seeded else 0.0,
            seed=rng.randrange(2**31) if seeded else None,
            cancel_after_chunks=cancel, deadline_s=deadline))
    return plan
