"""One Ray + Serve instance for the live Serve tests of this package (test_app_*.py,
test_ingress_failover.py): the app over a tiny checkpoint with an ingress and two engine
replicas, reached the way users reach it. Made by the first test that asks for it, shut down
after the package's last test, which then checks that nothing is left: no actor, no placement
group."""

from __future__ import annotations

import time

import pytest
from ray import serve

from raypaged.core.sampling_params import SamplingParams
from raypaged.llm import LLM
from raypaged.serve.chat_template import chat_prompt_token_ids
from tests.serve.serve_harness import ENGINE_ARGS, MAX_TOKENS, PROMPTS, engines_satisfy, idle_and_whole, serve_instance
from tests.support.checkpoints import checkpoint_dir
from tests.support.ray_state import held_across_modules, live_actors, live_placement_groups


@pytest.fixture(scope="package")
def server():
    model = str(checkpoint_dir("llama"))
    args = {"model": model, "num_replicas": 2, "tool_call_parser": "hermes", "enable_auto_tool_choice": True,
            **ENGINE_ARGS}
    with serve_instance(args, metrics=True) as ports, held_across_modules():
        engines_satisfy(idle_and_whole)
        yield {**ports, "model": model}
        serve.shutdown()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (live_actors() or live_placement_groups()):
            time.sleep(0.2)
        assert live_actors() == [] and live_placement_groups() == []


@pytest.fixture(scope="package")
def oracle(server):
    """The offline engine's greedy continuations of PROMPTS, and its tokenizer."""
    llm = LLM(server["model"], num_gpu_blocks_override=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params)
        chat_ids = chat_prompt_token_ids(llm.tokenizer, [{"role": "user", "content": PROMPTS[0]}], 10**6)
        chat_output = llm.generate({"prompt_token_ids": chat_ids}, params)[0].outputs[0]
        yield {"outputs": [o.outputs[0] for o in outputs], "chat": chat_output, "tokenizer": llm.tokenizer}
    finally:
        llm.shutdown()
