"""The multi-turn chat trace of bench_serving (benchmarks/serving_chat.py) without a server: the
seeded plan (lengths, turns, the max_total_len cap), the ids drawn for it, and a conversation
sent through a fake client — every turn resends the whole history with the replies as they
were streamed back, after its think time."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time

import grpc
import pytest

from benchmarks.lib.sharegpt import FIRST_ID
from benchmarks.serving_chat import (
    ChatShape,
    Conversation,
    ConversationRun,
    Turn,
    conversation_summary,
    conversations_at,
    converse,
    plan_conversations,
    system_prompt,
    user_messages,
)
from benchmarks.serving_report import Timing
from raypaged.client import CompletionChunk, RequestError, StreamChunk, Usage

SHAPE = ChatShape(system_len=500, user_mean=100, reply_mean=200, min_turns=3, max_turns=8,
                  think_mean_s=2.0)
VOCAB = 3072


def test_plan_is_seeded_and_lengths_have_the_shape():
    plan = plan_conversations(3000, SHAPE, max_total_len=10**6, seed=0)
    assert plan == plan_conversations(3000, SHAPE, max_total_len=10**6, seed=0)
    assert plan[:50] != plan_conversations(50, SHAPE, max_total_len=10**6, seed=1)
    turns = [t for c in plan for t in c.turns]
    # Uncapped: every conversation keeps its 3-8 drawn turns, uniformly.
    assert all(len(c.turns) == c.drawn_turns for c in plan)
    assert {len(c.turns) for c in plan} == set(range(3, 9))
    assert statistics.mean(len(c.turns) for c in plan) == pytest.approx(5.5, abs=0.15)
    assert statistics.mean(t.user_len for t in turns) == pytest.approx(100, rel=0.1)
    assert statistics.mean(t.reply_len for t in turns) == pytest.approx(200, rel=0.1)
    assert statistics.median(t.reply_len for t in turns) < 150  # lognormal: a long right tail
    assert all(c.turns[0].think_s == 0 for c in plan)
    later = [t.think_s for c in plan for t in c.turns[1:]]
    assert min(later) >= 0 and statistics.mean(later) == pytest.approx(2.0, rel=0.1)


def test_max_total_len_ends_conversations_and_keeps_the_same_turns():
    wide = plan_conversations(400, SHAPE, max_total_len=10**6, seed=3)
    for cap in (4096, 2048, 1024):
        capped = plan_conversations(400, SHAPE, max_total_len=cap, seed=3)
        assert all(c.context_len(SHAPE.system_len) <= cap for c in capped)
        # A lower cap only ends conversations sooner: the turns it keeps are the same, but for a
        # first turn clipped to fit.
        for c, w in zip(capped, wide):
            assert c.drawn_turns == w.drawn_turns and c.turns[1:] == w.turns[1:len(c.turns)]
            assert c.turns[0].user_len <= w.turns[0].user_len and c.turns[0].reply_len <= w.turns[0].reply_len
            if len(c.turns) < len(w.turns):  # it stopped before the first turn that would not fit
                nxt = w.turns[len(c.turns)]
                assert c.context_len(SHAPE.system_len) + nxt.user_len + nxt.reply_len > cap
        assert any(len(c.turns) < c.drawn_turns for c in capped), cap
    # A first turn that cannot fit is clipped to the room the system prompt leaves.
    tight = plan_conversations(100, SHAPE, max_total_len=SHAPE.system_len + 10, seed=3)
    assert all(len(c.turns) == 1 and c.context_len(SHAPE.system_len) <= SHAPE.system_len + 10
               and c.turns[0].user_len >= 1 and c.turns[0].reply_len >= 1 for c in tight)
    with pytest.raises(ValueError, match="leaves no turn"):
        plan_conversations(1, SHAPE, max_total_len=SHAPE.system_len + 1, seed=0)
    with pytest.raises(ValueError, match="turns"):
        plan_conversations(1, ChatShape(10, 5, 5, 4, 3, 0.0), max_total_len=100, seed=0)


def test_a_rate_begins_rate_times_window_conversations_the_plans_first():
    assert [conversations_at(rate, 15.0) for rate in (0.01, 0.5, 1.0, 2.0, 2.05)] == [1, 8, 15, 30, 31]
    # The first conversations of a longer plan are the shorter plan's: every rate's are the same.
    assert plan_conversations(40, SHAPE, 2048, seed=5)[:15] == plan_conversations(15, SHAPE, 2048, seed=5)


def test_ids_system_prompt_fixed_user_messages_fresh_per_rate():
    plan = plan_conversations(20, SHAPE, max_total_len=4096, seed=0)
    system = system_prompt(SHAPE.system_len, VOCAB, seed=0)
    assert len(system) == SHAPE.system_len and system == system_prompt(SHAPE.system_len, VOCAB, 0)
    assert system != system_prompt(SHAPE.system_len, VOCAB, seed=1)
    first, again, other = (user_messages(plan, VOCAB, f"users:0:{rate}") for rate in (1.0, 1.0, 2.0))
    assert first == again
    assert [[len(m) for m in c] for c in first] == [[t.user_len for t in c.turns] for c in plan]
    assert all(FIRST_ID <= t < VOCAB for c in first for m in c for t in m + system)
    # No message of one rate recurs at another (its blocks could be served from the cache).
    assert not any(a[:8] == b[:8] for ca, cb in zip(first, other) for a, b in zip(ca, cb))


def stream_chunk(token_ids: list[int], usage: Usage | None = None) -> StreamChunk:
    """What the client yields: one sample's new tokens, the usage on the stream's last."""
    return StreamChunk("r", [CompletionChunk(0, "", token_ids, None, None, None)], usage)


class FakeChatServer:
    """Replies with random ids (nothing a client could make up), two chunks a reply, and
    records every prompt with when it arrived; turn `fail_at` (counting all calls) fails."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.rng = random.Random(7)
        self.prompts: list[list[int]] = []
        self.replies: list[list[int]] = []
        self.asked: list[dict] = []
        self.sent_at: list[float] = []
        self.done_at: list[float] = []
        self.fail_at = fail_at

    async def stream(self, prompt, **params):
        self.prompts.append(list(prompt))
        self.asked.append(params)
        self.sent_at.append(time.perf_counter())
        if len(self.prompts) - 1 == self.fail_at:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "gone")
        reply = [self.rng.randrange(FIRST_ID, VOCAB) for _ in range(params["max_tokens"])]
        self.replies.append(reply)
        half = len(reply) // 2
        await asyncio.sleep(0.001)
        yield stream_chunk(reply[:half])
        self.done_at.append(time.perf_counter())
        yield stream_chunk(reply[half:], Usage(len(prompt), len(reply), 16))


def conversation(*lens: tuple[int, int], think_s: float = 0.0) -> Conversation:
    turns = tuple(Turn(u, r, think_s if i else 0.0) for i, (u, r) in enumerate(lens))
    return Conversation(turns, len(turns))


def test_every_turn_resends_the_whole_history_with_the_streamed_replies():
    server = FakeChatServer()
    system = system_prompt(40, VOCAB, 0)
    convs = [conversation((5, 7), (3, 4), (6, 2), think_s=0.02), conversation((2, 3), (4, 5))]
    messages = user_messages(convs, VOCAB, "users:0:1.0")

    async def both() -> list[ConversationRun]:
        now = time.perf_counter()
        return list(await asyncio.gather(*(converse(server, system, c, m, now)
                                           for c, m in zip(convs, messages))))

    runs = asyncio.run(both())
    by_conversation: dict[int, list[int]] = {0: [], 1: []}
    for i, prompt in enumerate(server.prompts):  # the two interleave: tell them by their first message
        owner = 0 if prompt[40:45] == messages[0][0] else 1
        by_conversation[owner].append(i)
    for c, (conv, users) in enumerate(zip(convs, messages)):
        calls = by_conversation[c]
        assert len(calls) == len(conv.turns) == len(runs[c].timings)
        history = list(system)  # the same system prompt opens every conversation
        for k, call in enumerate(calls):
            assert server.prompts[call] == history + users[k]
            assert server.asked[call] == {"max_tokens": conv.turns[k].reply_len, "ignore_eos": True,
                                          "temperature": 0.0}
            history = server.prompts[call] + server.replies[call]
        timing = runs[c].timings[-1]
        assert timing.error is None and timing.prompt_tokens == len(server.prompts[calls[-1]])
        assert timing.cached_tokens == 16 and timing.output_tokens == conv.turns[-1].reply_len
    # Each later turn is sent its think time after the previous one's reply ended.
    first = by_conversation[0]
    for a, b in zip(first, first[1:]):
        assert server.sent_at[b] - server.done_at[a] >= 0.02


def test_a_failed_turn_ends_its_conversation():
    server = FakeChatServer(fail_at=1)
    conv = conversation((5, 7), (3, 4), (6, 2))
    run = asyncio.run(converse(server, [3, 4, 5], conv, user_messages([conv], VOCAB, "u")[0],
                               time.perf_counter()))
    assert len(server.prompts) == 2 and len(run.timings) == 2
    assert run.timings[0].error is None and run.timings[1].error == "UNAVAILABLE: gone"
    other = ConversationRun([Timing(0.0, ttft_s=0.5, e2e_s=1.0, output_tokens=1)],
                            began=run.began + run.duration_s, duration_s=1.0)  # begins as `run` ends
    summary = conversation_summary([conv, conversation((1, 1))], [run, other], 2.0)
    counts = summary["conversations"]
    assert (counts["count"], counts["completed"], counts["turns_planned"], counts["turns_sent"]) == (2, 1, 4, 3)
    assert counts["completed_per_s"] == 0.5 and counts["peak_in_progress"] == 1
    assert counts["mean_in_progress"] == pytest.approx((run.duration_s + 1.0) / 2.0)
    assert math.isnan(summary["ttft_later_turns"]["p50_ms"])  # no later turn completed
    assert summary["ttft_first_turn"]["p50_ms"] == pytest.approx(1e3 * (run.timings[0].ttft_s + 0.5) / 2)
