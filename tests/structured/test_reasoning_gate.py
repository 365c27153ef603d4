"""A grammar that starts after the reasoning: StructuredOutput.reasoning_end_token_ids.

Until the output produces the gate's tokens, every token is free (the sample equals the
unconstrained one); from the token after it, the grammar holds. Sync and async scheduling give
the same tokens; the serve layer gates only when the prompt has not closed the reasoning.
"""

from __future__ import annotations

import re

import pytest

from raypaged import LLM, SamplingParams
from raypaged.client import structured_output_to_proto
from raypaged.core.errors import InvalidRequestError
from raypaged.core.structured_output import StructuredOutput
from raypaged.frontend.validation import structured_output_from_proto
from raypaged.serve.reasoning_gate import reasoning_gate
from tests.support.hf_oracle import random_prompts, vocab_of

NAME = "llama"
PATTERN = r"[a-e]{30,80}"


def _tokens(llm: LLM, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    [result] = llm.generate([{"prompt_token_ids": prompt}], params)
    return [o.token_ids for o in result.outputs]


def test_the_grammar_holds_from_the_token_after_the_gate(engines):
    [prompt] = random_prompts([6], vocab_of(NAME), seed=31)
    free = _tokens(engines["sync"], prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    gate = (free[4], free[5])  # a two-token gate, first produced at positions 4-5 or before
    end = next(i + 2 for i in range(len(free) - 1) if (free[i], free[i + 1]) == gate)
    spec = StructuredOutput(regex=PATTERN, reasoning_end_token_ids=gate)
    runs = {}
    for mode, llm in engines.items():
        [tokens] = _tokens(llm, prompt, SamplingParams(temperature=0.0, max_tokens=40, structured_output=spec))
        assert tokens[:end] == free[:end]  # the reasoning: unconstrained
        assert re.fullmatch(r"[a-e]*", llm.tokenizer.decode(tokens[end:])), tokens[end:]
        assert len(tokens) > end
        runs[mode] = tokens
    assert runs["sync"] == runs["async"]
    ungated = _tokens(engines["sync"], prompt, SamplingParams(
        temperature=0.0, max_tokens=40, structured_output=StructuredOutput(regex=PATTERN)))[0]
    assert ungated != runs["sync"]  # without the gate the grammar holds from the first token


def test_sampled_samples_each_keep_their_own_gate_sync_as_async(engines):
    [prompt] = random_prompts([5], vocab_of(NAME), seed=32)
    free = _tokens(engines["sync"], prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    spec = StructuredOutput(regex=PATTERN, reasoning_end_token_ids=(free[2],))
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=30, structured_output=spec)
    runs = {mode: _tokens(llm, prompt, params) for mode, llm in engines.items()}
    assert runs["sync"] == runs["async"]
    for tokens in runs["sync"]:
        if free[2] in tokens:
            after = tokens[tokens.index(free[2]) + 1:]
            assert re.fullmatch(r"[a-e]*", engines["sync"].tokenizer.decode(after))


def test_the_gate_round_trips_through_the_grpc_message_and_is_checked():
    spec = StructuredOutput(json_object=True, reasoning_end_token_ids=(7, 8))
    assert structured_output_from_proto(structured_output_to_proto(spec)) == spec
    assert spec.key == StructuredOutput(json_object=True).key  # the same compiled grammar
    with pytest.raises(InvalidRequestError, match="reasoning_end_token_ids"):
        StructuredOutput(regex="a+", reasoning_end_token_ids=(-1,))


def test_the_serve_layer_gates_unless_the_prompt_closed_the_reasoning(engines):
    tokenizer = engines["sync"].tokenizer
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    assert reasoning_gate(tokenizer, ids("user: hi\nassistant: ")) == end  # the model may open it
    assert reasoning_gate(tokenizer, ids("assistant: <think>\n")) == end  # opened by the template
    assert reasoning_gate(tokenizer, ids("assistant: <think>\n\n</think>\n\n")) == ()  # thinking off
    assert reasoning_gate(tokenizer, ids("<think>a</think> then <think>\n")) == end
