"""End to end through LLM: constrained greedy outputs conform to their schema, regex or choices,
with asynchronous scheduling off and on, n = 2 and preemption; unconstrained neighbours stay
token-identical to transformers; invalid specs are refused before anything is queued."""

from __future__ import annotations

import random
import re

import jsonschema
import pytest
import xgrammar as xgr

from raypaged import LLM, SamplingParams
from raypaged.core.errors import InvalidRequestError
from raypaged.core.structured_output import StructuredOutput
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import hf_greedy, random_prompts, vocab_of
from tests.support.json_schemas import parse, random_schema

NAME = "llama"
MAX_TOKENS = 160


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request):
    engine = LLM(str(checkpoint_dir(NAME)), async_scheduling=request.param)
    yield engine
    engine.shutdown()


def accepted_prefix(llm: LLM, spec: StructuredOutput, token_ids: list[int]) -> bool:
    """Whether the grammar accepts every token (a valid partial document where max_tokens cut it)."""
    matcher = xgr.GrammarMatcher(llm.engine._structured_outputs().compiled(spec))
    return all(matcher.accept_token(t) for t in token_ids)


def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_random_json_schemas_validate(llm):
    rng = random.Random(0)
    schemas = [{"type": "object", "properties": {"k": random_schema(rng)}, "required": ["k"],
                "additionalProperties": False} for _ in range(6)]
    prompts = random_prompts([3, 9, 4, 12, 6, 1], vocab_of(NAME), seed=11)
    specs = [StructuredOutput(json=s) for s in schemas]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_output=s) for s in specs]
    results = generate(llm, prompts, params)
    finished = 0
    for schema, spec, result in zip(schemas, specs, results):
        out = result.outputs[0]
        if out.finish_reason == "stop":
            jsonschema.validate(parse(out.text), schema)
            finished += 1
        else:
            assert out.finish_reason == "length"
            assert accepted_prefix(llm, spec, out.token_ids)
    assert finished >= len(schemas) // 2  # the grammar, not the cap, ends most of them


def test_regex_choice_and_json_object(llm):
    prompts = random_prompts([5, 2, 8, 3], vocab_of(NAME), seed=12)
    pattern = r"[a-c]{2,4}-\d{1,3}"
    choices = ("yes", "no", "maybe so")
    specs = [StructuredOutput(regex=pattern), StructuredOutput(choice=choices),
             StructuredOutput(choice=choices), StructuredOutput(json_object=True)]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_output=s) for s in specs]
    regex, choice_a, choice_b, any_json = (r.outputs[0] for r in generate(llm, prompts, params))
    assert regex.finish_reason == "stop" and re.fullmatch(pattern, regex.text), regex.text
    for out in (choice_a, choice_b):
        assert out.finish_reason == "stop" and out.text in choices, out.text
    if any_json.finish_reason == "stop":
        parse(any_json.text)
    else:
        assert accepted_prefix(llm, specs[3], any_json.token_ids)


def test_unconstrained_neighbours_are_unchanged(llm):
    prompts = random_prompts([7, 13, 4], vocab_of(NAME), seed=13)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=40,
                                 structured_output=StructuredOutput(choice=("alpha", "beta")))
    results = generate(llm, prompts, [plain, constrained, plain])
    for i in (0, 2):
        assert results[i].outputs[0].token_ids == hf_greedy(checkpoint_dir(NAME), tuple(prompts[i]), 12)
    assert results[1].outputs[0].text in ("alpha", "beta")


def test_n_2_samples_each_follow_the_grammar(llm):
    schema = {"type": "object", "properties": {"v": {"enum": ["p", "q", "r"]}, "w": {"type": "boolean"}},
              "required": ["v", "w"], "additionalProperties": False}
    spec = StructuredOutput(json=schema)
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=MAX_TOKENS, structured_output=spec)
    [result] = generate(llm, random_prompts([6], vocab_of(NAME), seed=14), [params])
    assert len(result.outputs) == 2
    for out in result.outputs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(parse(out.text), schema)


@pytest.mark.parametrize("spec", [
    StructuredOutput(json='{"type": "object", "properties": {"a": {"type": "nope"}}}'),
    StructuredOutput(regex="(unclosed"),
    StructuredOutput(grammar="root ::= undefined_rule"),
])
def test_invalid_specs_are_refused_before_queueing(llm, spec):
    with pytest.raises(InvalidRequestError, match="invalid structured output"):
        generate(llm, [[1, 2, 3]], [SamplingParams(max_tokens=4, structured_output=spec)])
    # Nothing queued or compiling (a step of an earlier test may still be in flight: async).
    assert not llm.engine.scheduler.requests and not llm.engine._structured_outputs().num_compiling


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_keeps_constrained_outputs(async_scheduling):
    """On a pool too small for all of them, constrained requests are preempted and recomputed:
    their matchers carry on from their tokens, and the outputs equal a roomy run's."""
    spec = StructuredOutput(regex=r"(ab|cd|e){6,12}")
    prompts = random_prompts([20, 25, 30, 12], vocab_of(NAME), seed=15)
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_output=spec)] * 4
    outputs = []
    for blocks in (None, 14):
        kwargs = {"num_gpu_blocks_override": blocks} if blocks else {}
        engine = LLM(str(checkpoint_dir(NAME)), block_size=8, async_scheduling=async_scheduling, **kwargs)
        try:
            outputs.append([r.outputs[0].token_ids for r in generate(engine, prompts, params)])
            if blocks:
                assert engine.engine.scheduler.stats().num_preemptions > 0
            for r in generate(engine, prompts, params):
                assert re.fullmatch(r"(ab|cd|e){6,12}", r.outputs[0].text) or \
                    r.outputs[0].finish_reason == "length"
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]
