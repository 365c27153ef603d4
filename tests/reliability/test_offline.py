"""The offline LLM API under repeated calls: a sample that one call ends on a stop string is
aborted in the engine, and its abort record arrives during the next call; that call must ignore
it (it raised KeyError) and return its own outputs, the pool whole after each call."""

from __future__ import annotations

from raypaged import LLM, SamplingParams
from tests.support.checkpoints import checkpoint_dir


def test_calls_after_a_stop_string_ended_a_request():
    llm = LLM(str(checkpoint_dir("llama")), device="cpu", num_gpu_blocks_override=64)
    try:
        [free_run] = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=12, temperature=0.0))
        tokens = free_run.outputs[0].token_ids
        stop = llm.tokenizer.decode(tokens[2:4])  # text the greedy run produces early
        params = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop], ignore_eos=True)
        for _ in range(3):
            [result] = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
            assert result.outputs[0].finish_reason == "stop"
            assert stop not in result.outputs[0].text
        llm.engine.step()  # the last abort record goes out; nothing is left
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler.kv_cache_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


def test_n_samples_failed_before_their_fork_all_end():
    """The workers fail for good during an n > 1 prompt's prefill (before it forks): generate
    returns with every sample marked failed (it looped forever: only sample 0 ever ended)."""
    import threading

    from raypaged.executor.errors import WorkerGroupError
    from raypaged.llm import RequestsFailedError

    class NoWorkers:
        def __init__(self, *args):
            raise RuntimeError("no workers left")

    def fail(scheduler_output):
        raise WorkerGroupError("worker 0 died")

    llm = LLM(str(checkpoint_dir("llama")), device="cpu", num_gpu_blocks_override=64, max_worker_restarts=1)
    llm.engine._executor_class = NoWorkers
    llm.engine.executor.execute_model = fail
    errors: list[BaseException] = []

    def call() -> None:
        try:
            llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(n=3, max_tokens=8))
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=120)  # liveness only: it takes one failed step
    try:
        assert not thread.is_alive(), "generate never returned"
        [error] = errors
        assert isinstance(error, RequestsFailedError)
        [result] = error.outputs
        assert [o.finish_reason for o in result.outputs] == ["abort"] * 3
        assert all("gave up after 1 restarts" in o.error for o in result.outputs)
        assert llm.engine.scheduler.kv_cache_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        if not thread.is_alive():
            llm.shutdown()


def test_bad_text_is_refused_and_leaves_nothing_queued():
    """A lone UTF-16 surrogate (as a command-line byte that is not UTF-8 decodes to) in a text
    prompt or a stop string: InvalidRequestError naming it (the tokenizer raised a TypeError),
    and the good prompts of the same batch are not left running in the engine."""
    import pytest

    from raypaged.core.errors import InvalidRequestError

    llm = LLM(str(checkpoint_dir("llama")), device="cpu", num_gpu_blocks_override=64)
    try:
        with pytest.raises(InvalidRequestError, match="prompt: not valid text"):
            llm.generate(["fine", "bad \udcff"], SamplingParams(max_tokens=4))
        with pytest.raises(InvalidRequestError, match="stop strings must be valid text"):
            SamplingParams(stop=["\ud800"])
        # A batch whose second prompt the engine refuses (too long): the first is taken back.
        with pytest.raises(InvalidRequestError):
            llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5] * 10**4}],
                         SamplingParams(max_tokens=4))
        llm.engine.step()  # the abort records go out
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler.kv_cache_manager.num_free_blocks == llm.engine.num_blocks
        [ok] = llm.generate("fine", SamplingParams(max_tokens=4, temperature=0.0))
        assert ok.outputs[0].finish_reason is not None
    finally:
        llm.shutdown()
