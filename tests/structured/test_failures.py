"""What goes wrong with grammars, and what the engine does about it: a compile that outlives the
timeout or fails ends its request with an error while others keep decoding; a grammar that
reaches a dead end (no allowed token) ends the request as "abort" with stop_reason
structured_output_dead_end, never with an unconstrained token; nothing is leaked either way."""

from __future__ import annotations

import threading

import pytest

from raypaged import LLM, SamplingParams
from raypaged.core.structured_output import DEAD_END, StructuredOutput
from raypaged.llm import RequestsFailedError
from raypaged.structured.compiler import GrammarCompilerPool
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import hf_greedy, random_prompts, vocab_of

NAME = "llama"
CHOICES = ("yes", "no")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request):
    engine = LLM(str(checkpoint_dir(NAME)), async_scheduling=request.param,
                 structured_output_compile_timeout_s=0.5)
    yield engine
    engine.shutdown()


def _pool_whole(llm: LLM) -> bool:
    kv = llm.engine.scheduler.kv_cache_manager
    return kv.block_pool.num_free_blocks == kv.block_pool.num_blocks


def test_a_dead_end_ends_the_request_without_an_unconstrained_token(llm):
    """min_tokens bans EOS, the only token the grammar allows once "yes" / "no" is complete:
    the request stops there, its text still one of the choices."""
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12,
                            structured_output=StructuredOutput(choice=CHOICES))
    [prompt] = random_prompts([6], vocab_of(NAME), seed=31)
    [result] = llm.generate([{"prompt_token_ids": prompt}], params)
    out = result.outputs[0]
    assert out.finish_reason == "abort" and out.stop_reason == DEAD_END, out
    assert out.text in CHOICES
    assert _pool_whole(llm)


def test_a_compile_that_outlives_the_timeout_fails_only_its_request(llm, monkeypatch):
    """The grammar's compile blocks past compile_timeout_s: that request ends with an error
    naming the timeout, a plain request beside it decodes to transformers' tokens meanwhile."""
    release = threading.Event()
    real = GrammarCompilerPool._compile

    def slow(self, spec):
        if spec.regex == "slow+":
            release.wait(30)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompilerPool, "_compile", slow)
    prompts = random_prompts([5, 8], vocab_of(NAME), seed=32)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    slow_spec = SamplingParams(temperature=0.0, max_tokens=8, structured_output=StructuredOutput(regex="slow+"))
    try:
        with pytest.raises(RequestsFailedError, match="did not compile within 0.5 s") as raised:
            llm.generate([{"prompt_token_ids": p} for p in prompts], [slow_spec, plain])
    finally:
        release.set()
    slow_out, plain_out = raised.value.outputs
    assert slow_out.outputs[0].finish_reason == "abort" and not slow_out.outputs[0].token_ids
    assert plain_out.outputs[0].token_ids == hf_greedy(checkpoint_dir(NAME), tuple(prompts[1]), 8)
    assert _pool_whole(llm)


def test_a_compile_that_fails_ends_its_request_and_the_engine_serves_on(llm, monkeypatch):
    def broken(self, spec):
        raise RuntimeError("out of grammar memory")

    monkeypatch.setattr(GrammarCompilerPool, "_compile", broken)
    spec = StructuredOutput(regex="[a-c]{3,5}x")  # a spec of its own: not in the cache yet
    with pytest.raises(RequestsFailedError, match="failed to compile: out of grammar memory"):
        llm.generate([{"prompt_token_ids": [3, 4, 5]}],
                     SamplingParams(max_tokens=4, structured_output=spec))
    monkeypatch.undo()
    [again] = llm.generate([{"prompt_token_ids": [3, 4, 5]}],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(again.outputs[0].token_ids) == 4
    assert _pool_whole(llm)
