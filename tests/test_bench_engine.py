"""benchmarks/bench_engine.py's decode window on the tiny shape (CPU): it times the batch it was
asked for. With chunked prefill the first requests admitted decode while later prompts are still
being prefilled, so a window whose requests may produce only `steps` + a few tokens loses some of
them inside it and times a smaller batch (the batch-256 figures before 9ff8d2f); the window must
refuse to report that."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_engine  # noqa: E402
from common import SHAPES, write_config  # noqa: E402

from raypaged import LLM  # noqa: E402

BATCH, CONTEXT, STEPS, TOKEN_BUDGET = 8, 48, 4, 64  # 6 prefill steps of 64 tokens


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = write_config("tiny", "float32", tmp_path_factory.mktemp("tiny"))
    max_len = CONTEXT + bench_engine.decode_output_tokens(BATCH, CONTEXT, STEPS, TOKEN_BUDGET)
    engine = LLM(str(model_dir), load_format="dummy", dtype="float32", skip_tokenizer_init=True,
                 max_model_len=max_len, max_num_seqs=BATCH, max_num_batched_tokens=TOKEN_BUDGET,
                 kv_cache_memory_bytes=2**26)
    yield engine
    engine.shutdown()


def test_the_window_keeps_its_batch(llm):
    vocab = SHAPES["tiny"]["vocab_size"]
    step_ms, calls = bench_engine.decode_step_ms(llm, BATCH, CONTEXT, STEPS, vocab, torch.device("cpu"))
    assert step_ms > 0 and len(calls) == STEPS
    assert llm.engine.scheduler.num_running == 0  # the window's requests were aborted after it


def test_a_window_that_loses_requests_fails(llm, monkeypatch):
    # A budget of steps + 1 tokens: less than the first request decodes during the prefill.
    monkeypatch.setattr(bench_engine, "decode_output_tokens", lambda batch, context, steps, budget: steps + 1)
    vocab = SHAPES["tiny"]["vocab_size"]
    with pytest.raises(RuntimeError, match="shrank"):
        bench_engine.decode_step_ms(llm, BATCH, CONTEXT, STEPS, vocab, torch.device("cpu"))
    llm.engine.abort_requests([r.request_id for r in list(llm.engine.scheduler.running)])
