"""The decode benchmark on the tiny shape (CPU). Its window (benchmarks/lib/decode.py) times the
batch it was asked for. With chunked prefill the first requests admitted decode while later prompts are still
being prefilled, so a window whose requests may produce only `steps` + a few tokens loses some of
them inside it and times a smaller batch (the batch-256 figures before 9ff8d2f); the window must
refuse to report that. And every mode of benchmarks/bench_decode.py runs end to end (its figures
are for the GPU; here, that the machinery holds)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_decode
from benchmarks.lib import decode
from benchmarks.lib.common import SHAPES, write_config
from raypaged import LLM

BATCH, CONTEXT, STEPS, TOKEN_BUDGET = 8, 48, 4, 64  # 6 prefill steps of 64 tokens


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = write_config("tiny", "float32", tmp_path_factory.mktemp("tiny"))
    max_len = CONTEXT + decode.decode_output_tokens(BATCH, CONTEXT, STEPS, TOKEN_BUDGET)
    engine = LLM(str(model_dir), load_format="dummy", dtype="float32", skip_tokenizer_init=True,
                 max_model_len=max_len, max_num_seqs=BATCH, max_num_batched_tokens=TOKEN_BUDGET,
                 kv_cache_memory_bytes=2**26)
    yield engine
    engine.shutdown()


def test_the_window_keeps_its_batch(llm):
    vocab = SHAPES["tiny"]["vocab_size"]
    step_ms, calls = decode.decode_step_ms(llm, BATCH, CONTEXT, STEPS, vocab, torch.device("cpu"))
    assert step_ms > 0 and len(calls) == STEPS
    assert llm.engine.scheduler.num_running == 0  # the window's requests were aborted after it


def test_a_window_that_loses_requests_fails(llm, monkeypatch):
    # A budget of steps + 1 tokens: less than the first request decodes during the prefill.
    monkeypatch.setattr(decode, "decode_output_tokens", lambda batch, context, steps, budget: steps + 1)
    vocab = SHAPES["tiny"]["vocab_size"]
    with pytest.raises(RuntimeError, match="shrank"):
        decode.decode_step_ms(llm, BATCH, CONTEXT, STEPS, vocab, torch.device("cpu"))
    llm.engine.abort_requests([r.request_id for r in list(llm.engine.scheduler.running)])


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["time", "phases", "trace"])
def test_every_mode_runs_and_writes_its_result(mode, tmp_path):
    code = bench_decode.main(["--mode", mode, "--batch-sizes", "2", "--context", "16", "--steps", "2",
                              "--executors", "uni", "--scheduling", "async", "--throughput-batch", "2",
                              "--prompt-len", "8", "--output-len", "4", "--out", str(tmp_path)])
    assert code == 0
    name = {"time": "decode_tiny_cpu", "phases": "decode_phases_tiny_cpu", "trace": "decode_trace_tiny_cpu"}[mode]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["mode"] == mode and result["args"]["batch_sizes"] == "2"
    if mode == "time":
        (row,) = result["decode"]
        assert row["batch"] == 2 and row["step_ms"] > 0 and row["floor_ms"] > 0
        assert result["raypaged"]["output_tokens"] == 2 * 4
    elif mode == "phases":
        assert result["phases_us"]["uni/async/2"]["engine.step"] > 0
    else:
        assert result["runs"]["async/2"]["wall_ms"] > 0
    assert (tmp_path / f"{name}.png").exists() == (mode != "phases")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_byte_floor_counts_every_weight_the_step_reads(shape):
    """weight_bytes (the floor's weights: all but the embedding table, of which the batch's rows)
    against the parameters of the model raypaged builds for the shape, on the meta device."""
    from benchmarks.lib.model_step import model_config
    from raypaged.model.registry import MODEL_REGISTRY

    config = model_config(shape)
    with torch.device("meta"):
        model = MODEL_REGISTRY[config.architecture](config)
    params = {id(p): p for p in model.parameters()}
    embedding = model.model.embed_tokens.weight
    read = sum(p.numel() for p in params.values()) - (0 if model.lm_head.weight is embedding else embedding.numel())
    # Norm weights are counted as two a layer whatever the family: a few KB of slack.
    assert abs(decode.weight_bytes(shape, 2, 0) - 2 * read) <= 2 * 4 * config.hidden_size * config.num_hidden_layers
