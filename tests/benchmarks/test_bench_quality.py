"""The quality benchmark's pieces (benchmarks/lib/quality.py, bench_quality.py): perplexity
through raypaged's prompt logprobs equals transformers' loss on the same windows (fp32, CPU; with
chunked prefill cutting the windows and async scheduling on), FP8 weights + FP8 KV score the same
text close to it but not identically, the agreement measures count what they say, and the whole
benchmark runs on the demo model's held-out text. (Its figures are in benchmarks/results/.)"""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from benchmarks import bench_quality
from benchmarks.lib import quality
from raypaged import LLM
from tests.support.checkpoints import checkpoint_dir, demo_model_missing
from tests.support.hf_oracle import random_prompts, vocab_of

NAME = "llama"
# Windows of 24 tokens, chunks of 16: most windows are scored across two or three steps.
ENGINE = {"max_model_len": 64, "max_num_batched_tokens": 16, "enable_chunked_prefill": True, "block_size": 8}


@pytest.fixture(scope="module")
def windows() -> list[list[int]]:
    stream = [t for p in random_prompts([40] * 4, vocab_of(NAME), seed=41) for t in p]
    return quality.windows(stream, 24)


def hf_perplexity(chunks: list[list[int]]) -> tuple[float, torch.Tensor]:
    """transformers' mean next-token loss over the windows -> (perplexity, per-token logprobs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir(NAME), dtype=torch.float32).eval()
    ids = torch.tensor(chunks)
    with torch.inference_mode():
        out = model(input_ids=ids, labels=ids)
        logprobs = torch.log_softmax(out.logits[:, :-1].float(), dim=-1).gather(2, ids[:, 1:, None])[..., 0]
    return math.exp(out.loss.item()), logprobs


@pytest.fixture(scope="module")
def base_scores(windows) -> quality.Scores:
    llm = LLM(str(checkpoint_dir(NAME)), skip_tokenizer_init=True, **ENGINE)
    try:
        return quality.score(llm, windows)
    finally:
        llm.shutdown()


def test_perplexity_through_the_engine_equals_transformers(windows, base_scores):
    expected, logprobs = hf_perplexity(windows)
    assert base_scores.num_tokens == len(windows) * 23
    assert torch.allclose(torch.tensor(base_scores.logprobs), logprobs, atol=1e-4)
    assert abs(base_scores.perplexity() / expected - 1) < 1e-5
    assert quality.scores_against(base_scores, base_scores) == {
        "perplexity_change": 0.0, "top1_agreement": 1.0, "mean_abs_logprob_delta": 0.0}


def test_fp8_weights_and_kv_score_close_but_not_equal(windows, base_scores):
    scores, outputs, _ = bench_quality.run_mode(str(checkpoint_dir(NAME)), bench_quality.MODES["fp8"], windows,
                                                windows[:2], 6, ENGINE)
    against = quality.scores_against(base_scores, scores)
    # The e4m3 paths ran (measured 0.08 on this random model, whose near-flat distributions make
    # top-1 ties common: 0.83 agreement), and stayed close.
    assert 0 < against["mean_abs_logprob_delta"] < 0.2
    assert abs(against["perplexity_change"]) < 0.02
    assert against["top1_agreement"] > 0.7
    assert [len(o) for o in outputs] == [6, 6]


def test_agreement_counts_divergence_and_positions():
    base = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    other = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 0]]
    got = quality.greedy_agreement(base, other)
    assert got["first_divergence"] == [4, 1, 0]
    assert got["identical_prompts"] == 1
    assert got["prefix_agreement"] == 5 / 12
    assert got["positional_agreement"] == 9 / 12
    with pytest.raises(ValueError):
        quality.greedy_agreement(base, other[:2])
    scores = quality.Scores([[-1.0, -2.0]], [[3, 4]])
    assert scores.perplexity() == pytest.approx(math.exp(1.5))
    changed = quality.scores_against(scores, quality.Scores([[-1.0, -3.0]], [[3, 5]]))
    assert changed["top1_agreement"] == 0.5 and changed["mean_abs_logprob_delta"] == 0.5
    assert changed["perplexity_change"] == pytest.approx(math.exp(2.0) / math.exp(1.5) - 1)


def test_windows_cut_the_stream_from_its_start():
    assert quality.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert quality.windows(list(range(10)), 4, count=1) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError):
        quality.windows([1, 2], 4)


# The run's environment record asks git for the commit and `uname -p` for the processor.
@pytest.mark.integration
@pytest.mark.skipif(demo_model_missing(), reason="the demo model is not installed")
def test_the_benchmark_on_the_demo_models_held_out_text(tmp_path: Path):
    from raypaged.demo import demo_model_path

    info = json.loads((Path(demo_model_path()) / "training_info.json").read_text())
    held_out = quality.held_out_files(Path(demo_model_path()))
    assert {p.name for p in held_out} == set(info["held_out_files"])
    assert not {p.name for p in held_out} & set(info["train_files"])
    assert all(p.parent == Path(sysconfig.get_paths()["stdlib"]) for p in held_out)
    assert bench_quality.main(["--windows", "3", "--prompts", "2", "--prompt-len", "8", "--max-tokens", "4",
                               "--modes", "auto,fp8-kv", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "quality_demo_cpu.json").read_text())
    assert (tmp_path / "quality_demo_cpu.png").is_file()
    base, fp8 = result["results"]["auto"], result["results"]["fp8-kv"]
    assert base["scored_tokens"] == 3 * 127
    # The trained model on text like its training's: far below the 3,072-token vocabulary's
    # perplexity of a model that knows nothing.
    assert base["perplexity"] < 300
    assert fp8["greedy"]["tokens"] == 8 and len(fp8["greedy"]["first_divergence"]) == 2
