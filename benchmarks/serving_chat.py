"""The multi-turn chat trace of bench_serving (`--trace multiturn`): conversations that share one
system prompt, each turn resending the whole history, as OpenAI chat clients do.

The plan, drawn from the seed alone (the same at every rate and in every mode): per
conversation min_turns to max_turns turns (uniform); each turn a user message and a reply of
lognormal lengths (the ShareGPT-like trace's spread) and, from the second turn on, a think time
(exponential). Turn k sends

    system prompt + user_0 + reply_0 + ... + user_{k-1} + reply_{k-1} + user_k

where reply_j are the token ids the server streamed back for turn j, asks for exactly its reply
length (ignore_eos), and is sent its think time after turn k-1 finished. A conversation ends
after its last turn, or before the first turn whose prompt + reply would pass max_total_len;
its first turn is clipped to fit (as the simulator's traces clip to max_model_len).
Conversations begin at the Poisson times of the swept rate for a fixed window, so a rate r
brings about r x window of them: the plan's first ones, the same at every rate. (A fixed number
of conversations would stop loading the server at high rates: once all have begun, the load is
that many closed loops whatever the rate; the window should be a few conversations long.)

Several system prompts (`--system-prompts K`, the multi-tenant trace of `--trace multitenant`):
conversation i uses prompt i mod K, each drawn once from the seed like the single one (prompt 0
is the single trace's).

Token ids: the system prompt's are drawn once from the seed (the same prompt in every
conversation and at every rate: the cache may serve it, as a real deployment's would); the user
messages' anew at every rate, so that the cache can serve the system prompt and each
conversation's own history and nothing of another rate's.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

from benchmarks.lib.sharegpt import FIRST_ID
from benchmarks.serving_load import Load, LoadResult, drive, poisson_offsets, send
from benchmarks.serving_report import Timing, distribution
from raypaged.client import AsyncClient
from raypaged.simulator.traces import SHAREGPT_LOG_SIGMA, lognormal_length


@dataclass(frozen=True)
class ChatShape:
    """Lengths in tokens (means of the lognormals) and pacing of the conversations."""

    system_len: int
    user_mean: float
    reply_mean: float
    min_turns: int
    max_turns: int
    think_mean_s: float

    def validate(self, max_total_len: int) -> None:
        """ValueError for a shape no conversation could have under max_total_len."""
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError(f"turns must satisfy 1 <= min <= max, got {self.min_turns}, {self.max_turns}")
        if self.system_len < 0 or self.user_mean <= 0 or self.reply_mean <= 0 or self.think_mean_s < 0:
            raise ValueError(f"lengths must be positive and think time >= 0: {self}")
        if self.system_len + 2 > max_total_len:
            raise ValueError(f"a system prompt of {self.system_len} tokens leaves no turn under "
                             f"max_total_len {max_total_len}")


@dataclass(frozen=True)
class Turn:
    user_len: int
    reply_len: int
    think_s: float  # after the previous turn finished, before this one is sent; 0 for the first


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    drawn_turns: int  # before max_total_len ended it

    def context_len(self, system_len: int) -> int:
        """Tokens of the whole history once the last turn is done."""
        return system_len + sum(t.user_len + t.reply_len for t in self.turns)


def plan_conversations(count: int, shape: ChatShape, max_total_len: int, seed: int) -> list[Conversation]:
    """`count` conversations of `shape`, none whose context passes max_total_len. Every turn's
    lengths are drawn whether or not the cap keeps it, so a lower cap only ends conversations
    sooner: the turns it keeps are the same, but for a first turn clipped to fit."""
    shape.validate(max_total_len)
    rng = random.Random(f"multiturn:{seed}")
    room = max_total_len - shape.system_len
    conversations = []
    for _ in range(count):
        drawn = [(lognormal_length(rng, shape.user_mean, SHAREGPT_LOG_SIGMA, 1, max_total_len),
                  lognormal_length(rng, shape.reply_mean, SHAREGPT_LOG_SIGMA, 1, max_total_len),
                  rng.expovariate(1 / shape.think_mean_s) if shape.think_mean_s else 0.0)
                 for _ in range(rng.randint(shape.min_turns, shape.max_turns))]
        user, reply, _ = drawn[0]
        user = min(user, room - 1)
        reply = min(reply, room - user)
        turns, used = [Turn(user, reply, 0.0)], user + reply
        for user, reply, think_s in drawn[1:]:
            if used + user + reply > room:
                break
            turns.append(Turn(user, reply, think_s))
            used += user + reply
        conversations.append(Conversation(tuple(turns), len(drawn)))
    return conversations


def random_ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(length)]


def system_prompt(length: int, vocab_size: int, seed: int, index: int = 0) -> list[int]:
    """System prompt `index` (of every conversation, with one), from the seed alone."""
    return random_ids(random.Random(f"system:{seed}" + (f":{index}" if index else "")), length, vocab_size)


def user_messages(conversations: list[Conversation], vocab_size: int, seed: str) -> list[list[list[int]]]:
    """Each conversation's user messages (ids of the planned lengths), drawn from `seed`: the
    load draws them anew per rate."""
    rng = random.Random(seed)
    return [[random_ids(rng, t.user_len, vocab_size) for t in c.turns] for c in conversations]


def plan_summary(conversations: list[Conversation], shape: ChatShape, max_total_len: int) -> dict:
    turns = [t for c in conversations for t in c.turns]
    contexts = [c.context_len(shape.system_len) for c in conversations]
    return {"conversations": len(conversations), "turns": len(turns),
            "mean_turns": len(turns) / len(conversations),
            "conversations_ended_by_max_total_len": sum(len(c.turns) < c.drawn_turns
                                                        for c in conversations),
            "system_prompt_len": shape.system_len,
            "mean_user_len": sum(t.user_len for t in turns) / len(turns),
            "mean_reply_len": sum(t.reply_len for t in turns) / len(turns),
            "mean_final_context_len": sum(contexts) / len(contexts),
            "max_final_context_len": max(contexts), "max_total_len": max_total_len,
            "turns_range": [shape.min_turns, shape.max_turns], "mean_think_s": shape.think_mean_s}


@dataclass
class ConversationRun:
    timings: list[Timing]  # one per turn sent, in order; the last has the error if one failed
    began: float  # perf_counter at the first send
    duration_s: float  # first send to the last turn's end


async def converse(client: AsyncClient, system: list[int], conversation: Conversation,
                   users: list[list[int]], due: float) -> ConversationRun:
    """Sends the conversation's turns one after another, each with the whole history: the system
    prompt, every earlier user message and every reply as streamed back. The first is due at
    `due`; each later one its think time after the previous finished. A failed turn ends the
    conversation (its next prompt would need the reply)."""
    history = list(system)
    timings: list[Timing] = []
    began = time.perf_counter()
    for turn, user in zip(conversation.turns, users):
        if timings:
            due = time.perf_counter() + turn.think_s
            await _sleep_until(due)
        prompt = history + user
        reply: list[int] = []
        timing = await send(client, prompt, turn.reply_len, due, reply)
        timings.append(timing)
        if timing.error is not None:
            break
        history = prompt + reply
    return ConversationRun(timings, began, time.perf_counter() - began)


async def _sleep_until(when: float) -> None:
    delay = when - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


def conversations_at(rate: float, window_s: float) -> int:
    """How many conversations a rate begins in the window (at least one)."""
    return max(1, math.ceil(rate * window_s))


class ChatLoad(Load):
    """The conversations of a plan: a rate begins the first conversations_at(rate, window_s) of
    them, at Poisson times of that rate. The plan must hold enough for the highest rate."""

    unit = "conversations"

    def __init__(self, conversations: list[Conversation], shape: ChatShape, max_total_len: int,
                 vocab_size: int, seed: int, window_s: float, num_system_prompts: int = 1) -> None:
        self.conversations, self.shape, self.max_total_len = conversations, shape, max_total_len
        self.vocab_size, self.seed, self.window_s = vocab_size, seed, window_s
        self.systems = [system_prompt(shape.system_len, vocab_size, seed, k) for k in range(num_system_prompts)]

    def arrival_span_s(self, rate: float) -> float:
        return self.window_s

    def summary(self) -> dict:
        return {**plan_summary(self.conversations, self.shape, self.max_total_len),
                "arrival_window_s": self.window_s, "system_prompts": len(self.systems)}

    async def run(self, address: str, rate: float, channels: int) -> LoadResult:
        count = conversations_at(rate, self.window_s)
        if count > len(self.conversations):
            raise ValueError(f"{count} conversations at {rate:g}/s, the plan has {len(self.conversations)}")
        conversations = self.conversations[:count]
        users = user_messages(conversations, self.vocab_size, f"users:{self.seed}:{rate}")
        offsets = poisson_offsets(count, rate, f"conversations:{self.seed}:{rate}")
        runs, wall_s = await drive(address, offsets, channels, lambda client, i, due: converse(
            client, self.systems[i % len(self.systems)], conversations[i], users[i], due))
        return LoadResult([t for run in runs for t in run.timings], wall_s,
                          conversation_summary(conversations, runs, wall_s))

    def tail_s(self, previous: dict) -> float:
        return previous["conversations"]["duration"]["p99_ms"] / 1e3  # the longest to finish


def conversation_summary(conversations: list[Conversation], runs: list[ConversationRun],
                         wall_s: float) -> dict:
    """A rate's conversations: how many ran every turn, how long those took, and TTFT apart for
    first turns (the system prompt and one message to prefill) and later ones (a history the
    cache may hold, and the new message)."""
    done = [run for run, c in zip(runs, conversations)
            if len(run.timings) == len(c.turns) and all(t.error is None for t in run.timings)]
    first = [run.timings[0] for run in runs if run.timings and run.timings[0].error is None]
    later = [t for run in runs for t in run.timings[1:] if t.error is None]
    # Conversations in progress: +1 at a first send, -1 at the last turn's end (ends first at a tie).
    events = sorted([(run.began, 1) for run in runs] + [(run.began + run.duration_s, -1) for run in runs],
                    key=lambda e: (e[0], e[1]))
    in_progress = peak = 0
    for _, step in events:
        in_progress += step
        peak = max(peak, in_progress)
    return {"conversations": {
                "count": len(runs), "completed": len(done),
                "turns_planned": sum(len(c.turns) for c in conversations),
                "turns_sent": sum(len(run.timings) for run in runs),
                "completed_per_s": len(done) / wall_s,
                "mean_in_progress": sum(run.duration_s for run in runs) / wall_s,
                "peak_in_progress": peak,
                "duration": distribution([run.duration_s for run in done])},
            "ttft_first_turn": distribution([t.ttft_s for t in first]),
            "ttft_later_turns": distribution([t.ttft_s for t in later])}
