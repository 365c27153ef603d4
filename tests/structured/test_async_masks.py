"""Constrained requests under asynchronous scheduling: their masks come one step late.

A constrained request decodes every step with a placeholder input like any other; the step's
sampling waits for the mask that the next step brings (grammar_deferred). These tests hold it to
what sync scheduling does: the same greedy tokens, a token every step (not every other), flushed
by an empty step when nothing else runs, and the manager's bookkeeping itself.
"""

from __future__ import annotations

import re

import pytest

from raypaged import LLM, SamplingParams
from raypaged.core.outputs import SchedulerOutput
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, Request
from raypaged.core.structured_output import StructuredOutput
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import random_prompts, vocab_of

NAME = "llama"
PATTERN = r"[a-e]{30,80}"


def _greedy(max_tokens: int, spec: StructuredOutput | None, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_output=spec, **kwargs)


def test_async_greedy_equals_sync_in_a_mixed_batch_with_n_2(engines):
    """Constrained and plain requests side by side, a seeded n = 2 among them: every token the
    same with the masks deferred as with them computed at schedule time."""
    prompts = random_prompts([5, 9, 3, 7], vocab_of(NAME), seed=21)
    choice = StructuredOutput(choice=("alpha", "beta", "gamma delta"))
    params = [_greedy(20, StructuredOutput(regex=PATTERN)), _greedy(12, None, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30,
                             structured_output=StructuredOutput(regex=PATTERN)),
              _greedy(30, choice)]
    runs = {}
    for mode, llm in engines.items():
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs[mode] = [[o.token_ids for o in r.outputs] for r in results]
        assert all(re.fullmatch(r"[a-e]*", o.text) for o in results[0].outputs + results[2].outputs)
        assert results[3].outputs[0].text in choice.choice
    assert runs["sync"] == runs["async"]


def test_a_constrained_request_alone_gets_a_token_every_step(engines):
    """Alone in the batch, its steps chain through the deferred masks: about one engine step a
    token (sitting out every other step would take twice as many)."""
    llm = engines["async"]
    engine = llm.engine
    [prompt] = random_prompts([6], vocab_of(NAME), seed=22)
    max_tokens = 24
    engine.add_request(Request("alone", prompt, _greedy(max_tokens, StructuredOutput(regex=PATTERN))))
    steps_with_tokens, tokens, finished = 0, 0, False
    for _ in range(500):
        if finished and not engine.has_unfinished_requests():
            break
        produced = [o for o in engine.step() if o.req_id == "alone"]
        if tokens or any(o.new_token_ids for o in produced):
            steps_with_tokens += 1
        tokens += sum(len(o.new_token_ids) for o in produced)
        finished = finished or any(o.finish_reason is not None for o in produced)
    assert finished and tokens == max_tokens
    # The first token's step, one per further token, and the step that flushes the last.
    assert steps_with_tokens <= max_tokens + 2, steps_with_tokens


def test_manager_defers_a_step_whose_input_is_in_flight(engines):
    """fill_bitmask on hand-made steps: a placeholder input defers the masks to the next step,
    whose row is then the matcher's mask after the token came back; a request gone meanwhile
    gets a row allowing every token."""
    import numpy as np
    import xgrammar as xgr

    manager = engines["async"].engine._structured_outputs()
    request = Request("hand", [5, 6, 7], _greedy(8, StructuredOutput(regex=r"(ab|cd)+")))
    manager.add(request)
    while manager.num_compiling:
        manager.wait(1.0)
        assert not manager.poll()[1]
    constraint = request.constraint
    assert constraint is not None
    live = {"hand": request}

    def step(num_computed: int) -> SchedulerOutput:
        request.num_computed_tokens = num_computed  # as the async scheduler leaves it
        request.all_token_ids.append(PLACEHOLDER_TOKEN_ID)  # the token the step samples
        out = SchedulerOutput(num_scheduled_tokens={"hand": 1}, total_num_scheduled_tokens=1)
        manager.fill_bitmask(out, live, lambda group: True)
        return out

    def own_mask() -> np.ndarray:
        bitmask = xgr.allocate_token_bitmask(1, manager._compilers.vocab_size)
        constraint.fill(bitmask, 0)
        return bitmask.numpy()

    prefill = step(3)  # the prompt's last chunk: every input known, the mask now
    assert not prefill.grammar_deferred and np.array_equal(prefill.grammar_bitmask, own_mask())
    decode = step(4)  # its input is the prefill's token, still in flight
    assert decode.grammar_deferred and decode.grammar_bitmask is None
    assert decode.grammar_req_ids == ["hand"]
    # The prefill's answer: update_from_output puts the token in and the matcher takes it.
    token = next(t for t in range(vocab_of(NAME)) if constraint.fork().accept(t))
    request.all_token_ids[3] = token
    assert constraint.accept(token)
    after = step(5)
    assert after.deferred_req_ids == ["hand"]
    assert np.array_equal(after.deferred_bitmask, own_mask())
    assert after.grammar_deferred  # its own input (the decode's token) is in flight again

    gone = SchedulerOutput()  # nothing scheduled, the request aborted: still the masks
    manager.fill_bitmask(gone, {}, lambda group: False)
    assert gone.deferred_req_ids == ["hand"] and not gone.grammar_deferred
    everything = xgr.allocate_token_bitmask(1, manager._compilers.vocab_size).numpy()
    assert np.array_equal(gone.deferred_bitmask, everything)
    idle = SchedulerOutput()
    manager.fill_bitmask(idle, {}, lambda group: False)
    assert idle.deferred_bitmask is None and not idle.deferred_req_ids


@pytest.mark.gpu
def test_on_cuda_with_cuda_graphs_async_equals_sync():
    """On the GPU the deferred step's logits live between two calls beside the captured decode
    graphs (whose outputs the next replay overwrites): the tokens still equal sync scheduling's."""
    prompts = random_prompts([5, 9, 3, 7, 12], vocab_of(NAME), seed=23)
    params = [_greedy(24, StructuredOutput(regex=PATTERN)), _greedy(16, None, ignore_eos=True),
              _greedy(24, StructuredOutput(choice=("alpha", "beta", "gamma delta"))),
              _greedy(24, StructuredOutput(json_object=True)), _greedy(16, None, ignore_eos=True)]
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(str(checkpoint_dir(NAME)), device="cuda", dtype="float32", max_num_seqs=8,
                  async_scheduling=async_scheduling)
        try:
            assert llm.engine.executor.worker.runner.decode_graphs is not None
            results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        finally:
            llm.shutdown()
        runs.append([r.outputs[0].token_ids for r in results])
        assert re.fullmatch(r"[a-e]*", results[0].outputs[0].text)
        assert results[2].outputs[0].text in ("alpha", "beta", "gamma delta")
    assert runs[0] == runs[1]
