"""Piecewise CUDA graphs (raypaged/worker/piecewise_graph.py).

On CPU the pieces run eagerly — the very code the graphs capture, on the same static buffers,
padded to the same buckets — and must equal the ordinary forward bit for bit (fp32): logits of
every position and the K/V written to the pool. The attention buffer's padded rows are poisoned
with NaN, so a padded row leaking into a real one would show. The `gpu` tests capture the graphs
and check greedy output against transformers with steps that mix decodes and prefill chunks:

    TRITON_INTERPRET=0 python3 -m pytest -q -m gpu tests/worker/test_piecewise_graphs.py
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from raypaged import LLM, SamplingParams
from raypaged.core.request import Request
from raypaged.model.attention import AttentionMetadata
from raypaged.model.config import ModelConfig
from raypaged.model.loader import load_model
from raypaged.worker.piecewise_graph import PiecewiseGraphs, piecewise_sizes
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import hf_greedy, random_prompts
from tests.support.model_harness import PagedHarness, run_mixed_schedule


@functools.cache
def our_model(name: str) -> tuple[torch.nn.Module, ModelConfig]:
    path = checkpoint_dir(name)
    return load_model(path, dtype=torch.float32, progress=False), ModelConfig.from_pretrained(path)


class PiecewiseModel(torch.nn.Module):
    """The model's interface for PagedHarness, its forward run by PiecewiseGraphs (uncaptured).

    `poison` fills the buffers' rows that a padded step reads without writing (the attention
    output, and the input ids / positions past the step's tokens) before every step."""

    def __init__(self, model: torch.nn.Module, sizes: list[int], poison: str = "nan") -> None:
        super().__init__()
        self.inner = model
        self.sizes = sizes
        self.poison = poison
        self.graphs: PiecewiseGraphs | None = None
        self.buckets_used: set[int] = set()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        if self.graphs is None:
            self.graphs = PiecewiseGraphs(self.inner, kv_caches, self.sizes, input_ids.device)
        graphs = self.graphs
        if self.poison == "nan":
            graphs.attn_out.fill_(float("nan"))
            graphs.input_ids.zero_()
            graphs.positions.zero_()
        else:
            graphs.attn_out.normal_(std=100.0)
            graphs.input_ids.random_(0, self.inner.config.vocab_size)
            graphs.positions.random_(0, 200)
        t = input_ids.shape[0]
        assert graphs.can_run(t)
        self.buckets_used.add(min(s for s in graphs.sizes if s >= t))
        # A copy: the buffer is rewritten by the next step, the harness keeps the logits.
        return graphs.run(input_ids, positions, meta).clone()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)


class CountingModel(torch.nn.Module):
    """The ordinary forward, recording each step's token count."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.step_tokens: list[int] = []

    def forward(self, input_ids: torch.Tensor, *args) -> torch.Tensor:
        self.step_tokens.append(input_ids.shape[0])
        return self.inner(input_ids, *args)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)


def run(name: str, forward: torch.nn.Module, schedule: Callable[[PagedHarness], None]) -> PagedHarness:
    harness = PagedHarness(forward, our_model(name)[1], block_size=8, num_blocks=48, seed=1)
    schedule(harness)
    return harness


def assert_same_run(expected: PagedHarness, actual: PagedHarness, bitwise: bool) -> None:
    assert actual.tokens == expected.tokens  # the same greedy tokens were fed back
    tolerance = dict(rtol=0, atol=0) if bitwise else dict(rtol=1e-5, atol=1e-5)
    for req in expected.tokens:
        torch.testing.assert_close(actual.logits_of(req), expected.logits_of(req), **tolerance)
    for expected_kv, actual_kv in zip(expected.kv_caches, actual.kv_caches, strict=True):
        for e, a in zip(expected_kv, actual_kv, strict=True):
            assert torch.equal(a.isnan(), e.isnan())  # the same slots written, none else
            torch.testing.assert_close(a, e, equal_nan=True, **tolerance)


def mixed_schedule(name: str) -> Callable[[PagedHarness], None]:
    """A batched prefill, then one prompt's second chunk (over its cached first half) beside the
    others' decodes, then decodes."""
    config = our_model(name)[1]
    generator = torch.Generator().manual_seed(4)
    prompts = {f"req{i}": torch.randint(3, config.vocab_size, (n,), generator=generator).tolist()
               for i, n in enumerate((5, 17, 1, 30))}
    return lambda h: run_mixed_schedule(h, prompts, decode_steps=4, chunk="req3")


def extend_schedule(harness: PagedHarness) -> None:
    """A request extending 20 computed tokens by 7 (as after a prefix-cache hit) beside a
    decode, then a lone decode."""
    generator = torch.Generator().manual_seed(5)
    vocab = our_model("llama")[1].vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    harness.add_tokens("a", tokens(20))
    harness.add_tokens("b", tokens(9))
    harness.step({"a": 20, "b": 9})
    harness.add_tokens("a", tokens(7))
    harness.add_tokens("b", [4])
    harness.step({"a": 7, "b": 1})
    harness.add_tokens("b", [5])
    harness.step({"b": 1})


SCHEDULES = [("llama", "mixed"), ("qwen2", "mixed"), ("llama-tied", "mixed"), ("llama", "extend")]


def schedule_of(name: str, kind: str) -> Callable[[PagedHarness], None]:
    return mixed_schedule(name) if kind == "mixed" else extend_schedule


def test_bucket_sizes():
    assert piecewise_sizes(2048) == [8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                                     1536, 2048]
    assert piecewise_sizes(100) == [8, 16, 32, 48, 64, 96, 100]
    assert piecewise_sizes(16) == [8, 16]
    assert piecewise_sizes(5) == [5]


@pytest.mark.parametrize("name, kind", SCHEDULES)
def test_the_pieces_are_bitwise_the_forward(name, kind):
    """Buckets equal to the steps' token counts (no padding): the split alone changes nothing,
    to the bit, in the logits of every position and in the K/V pool."""
    model = our_model(name)[0]
    counting = CountingModel(model)
    eager = run(name, counting, schedule_of(name, kind))
    piecewise = run(name, PiecewiseModel(model, counting.step_tokens), schedule_of(name, kind))
    assert_same_run(eager, piecewise, bitwise=True)


def test_the_pieces_are_bitwise_the_forward_on_the_kernels_path():
    """The same through the Triton kernels (the interpreter): the rope tables piece 0 computes
    and keeps for the other pieces ([T, D/2] fp32 on this path) rotate as the forward's do."""
    from raypaged.kernels import ops

    model = our_model("llama")[0]
    counting = CountingModel(model)
    ops.set_backend("triton")
    try:
        eager = run("llama", counting, mixed_schedule("llama"))
        pieces = PiecewiseModel(model, counting.step_tokens)
        piecewise = run("llama", pieces, mixed_schedule("llama"))
    finally:
        ops.set_backend("auto")
    assert pieces.graphs.rope_on_kernels and pieces.graphs.rope_cos.dtype == torch.float32
    assert_same_run(eager, piecewise, bitwise=True)


@pytest.mark.parametrize("name, kind", SCHEDULES)
def test_padded_rows_never_reach_the_real_ones(name, kind):
    """Steps padded to buckets 8, 16, 32, 48, 64: whatever the padded rows hold (NaN, or random
    ids, positions and attention outputs) the real rows come out bit-identical, and equal the
    eager forward to fp32 rounding (the BLAS may pick another kernel for the padded M)."""
    model = our_model(name)[0]
    eager = run(name, model, schedule_of(name, kind))
    nan_padded = PiecewiseModel(model, piecewise_sizes(64), poison="nan")
    with_nan = run(name, nan_padded, schedule_of(name, kind))
    with_noise = run(name, PiecewiseModel(model, piecewise_sizes(64), poison="random"),
                     schedule_of(name, kind))
    assert_same_run(with_nan, with_noise, bitwise=True)
    assert_same_run(eager, with_nan, bitwise=False)
    assert len(nan_padded.buckets_used) >= 2


def record_calls(obj: object, name: str) -> list[tuple[int, int]]:
    """Wrap obj.name(input_ids, positions, ..., metadata); record (tokens, decodes) per call."""
    calls: list[tuple[int, int]] = []
    original = getattr(obj, name)

    def wrapper(input_ids, positions, *args):
        calls.append((input_ids.shape[0], args[-1].num_decodes))
        return original(input_ids, positions, *args)

    setattr(obj, name, wrapper)
    return calls


def test_runner_uses_piecewise_graphs_for_mixed_steps_and_matches_transformers():
    """The ModelRunner's dispatch through PiecewiseGraphs (uncaptured on CPU) in a real engine:
    a small token budget chunks the prompts, so steps mix decodes and prefill chunks."""
    prompts = random_prompts([45, 3, 30, 12], our_model("llama")[1].vocab_size, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(checkpoint_dir("llama")), max_num_batched_tokens=16, block_size=8)
    runner = llm.engine.executor.worker.runner
    assert runner.piecewise_graphs is None  # never captured on CPU
    runner.piecewise_graphs = PiecewiseGraphs(runner.model, runner.kv_caches, piecewise_sizes(16),
                                              runner.device)
    piecewise_calls = record_calls(runner.piecewise_graphs, "run")
    eager_calls = record_calls(runner.model, "forward")
    try:
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    assert eager_calls == []  # every step fits the 16-token bucket
    decodes = [n for _, n in piecewise_calls]
    assert any(n > 0 for n in decodes) and any(n == 0 for n in decodes)  # mixed and prefill-only
    for prompt, result in zip(prompts, results):
        assert result.outputs[0].token_ids == hf_greedy(checkpoint_dir("llama"), tuple(prompt), 8)


# ---- on CUDA: the graphs captured ---------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def staggered_generate(llm: LLM, prompts: list[list[int]], max_tokens: int,
                       arrivals: list[int]) -> list[list[int]]:
    """Request i is added before engine step arrivals[i], so prefills land among decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished: set[str] = set()
    step = 0
    while len(finished) < len(prompts):
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                llm.engine.add_request(Request(str(i), list(prompts[i]), params))
        for out in llm.engine.step():
            outputs[out.group_id].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.group_id)
        step += 1
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_on_cuda_piecewise_graphs_match_transformers_and_the_eager_path(name, async_scheduling):
    vocab = our_model(name)[1].vocab_size
    prompts = random_prompts([40, 7, 1, 70, 17, 33], vocab, seed=21)
    arrivals = [0, 0, 2, 3, 5, 9]
    kwargs = dict(device="cuda", dtype="float32", block_size=16, max_num_seqs=8,
                  max_num_batched_tokens=48, async_scheduling=async_scheduling)
    results = {}
    for piecewise in (True, False):
        llm = LLM(str(checkpoint_dir(name)), piecewise_cuda_graph=piecewise, **kwargs)
        try:
            runner = llm.engine.executor.worker.runner
            assert runner.decode_graphs is not None
            assert (runner.piecewise_graphs is not None) == piecewise
            if piecewise:
                assert runner.piecewise_graphs.captured
                assert runner.piecewise_graphs.sizes[-1] == 48
                calls = record_calls(runner.piecewise_graphs, "run")
            eager_calls = record_calls(runner.model, "forward")
            results[piecewise] = staggered_generate(llm, prompts, 12, arrivals)
            if piecewise:
                assert eager_calls == []
                assert any(0 < decodes < tokens for tokens, decodes in calls), calls  # mixed steps
            else:
                assert any(0 < decodes < tokens for tokens, decodes in eager_calls)
        finally:
            llm.shutdown()
    for prompt, tokens in zip(prompts, results[True]):
        assert tokens == hf_greedy(checkpoint_dir(name), tuple(prompt), 12)
    assert results[True] == results[False]


@pytest.mark.gpu
@gpu
def test_on_cuda_steps_above_the_bucket_cap_run_eagerly():
    """Steps of more tokens than the largest bucket (the 100- and 60-token prefills) run
    eagerly, the smaller mixed ones piecewise, decode-only ones on the full graphs."""
    vocab = our_model("llama")[1].vocab_size
    prompts = random_prompts([100, 5, 60], vocab, seed=22)
    llm = LLM(str(checkpoint_dir("llama")), device="cuda", dtype="float32", block_size=16,
              max_num_seqs=4, piecewise_cuda_graph_max_tokens=32)
    try:
        runner = llm.engine.executor.worker.runner
        assert runner.piecewise_graphs.sizes == [8, 16, 32]
        piecewise_calls = record_calls(runner.piecewise_graphs, "run")
        eager_calls = record_calls(runner.model, "forward")
        outputs = staggered_generate(llm, prompts, 10, [0, 1, 2])
    finally:
        llm.shutdown()
    eager_tokens = [tokens for tokens, _ in eager_calls]
    assert 100 in eager_tokens and all(tokens > 32 for tokens in eager_tokens)
    assert piecewise_calls and all(tokens <= 32 for tokens, _ in piecewise_calls)
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == hf_greedy(checkpoint_dir("llama"), tuple(prompt), 10)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_on_two_gpus_tensor_parallel_piecewise_graphs_match_transformers():
    """TP = 2 over Ray: the pieces' all-reduces (row-parallel linears, vocab-parallel embedding)
    are captured NCCL calls."""
    vocab = our_model("llama")[1].vocab_size
    prompts = random_prompts([70, 5, 40, 12], vocab, seed=23)
    llm = LLM(str(checkpoint_dir("llama")), tensor_parallel_size=2, device="cuda",
              dtype="float32", block_size=16, max_num_seqs=8, max_num_batched_tokens=32)
    try:
        outputs = staggered_generate(llm, prompts, 10, [0, 0, 2, 4])
    finally:
        llm.shutdown()
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == hf_greedy(checkpoint_dir("llama"), tuple(prompt), 10)
