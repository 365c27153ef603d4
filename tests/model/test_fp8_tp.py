"""FP8 at tp 2 (gloo, two processes) against tp 1.

Quantized at load, every rank's e4m3 weights and scales are exactly TP 1's for its slice: a
column-parallel rank's rows are whole, and a row-parallel rank's rows take their maxima
all-reduced over the group. The activations entering a row-parallel layer are quantized per
token over this rank's slice of the features (as vLLM does; one more collective per layer would
make them TP 1's), so the logits agree within that rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raypaged.model import parallel
from raypaged.model.loader import load_model
from tests.support.checkpoints import checkpoint_dir
from tests.support.fp8_checkpoints import compressed_tensors_dir
from tests.support.model_harness import PagedHarness, run_mixed_schedule

# Two processes and two loads per case: about a minute on CI's two cores.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORLD_SIZE = 2
PROMPT_LENGTHS = (6, 19, 1, 26)
DECODE_STEPS = 3


@functools.cache
def _paths() -> dict[str, str]:
    return {"at-load": str(checkpoint_dir("llama")), "ct-static": str(compressed_tensors_dir("tensor", "static"))}


def _run(path: str, tp: int) -> dict:
    model = load_model(path, dtype=torch.float32, quantization="fp8", progress=False)
    harness = PagedHarness(model, model.config, block_size=8, num_blocks=40, tp=tp, seed=1)
    generator = torch.Generator().manual_seed(2)
    prompts = {f"req{i}": torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist()
               for i, n in enumerate(PROMPT_LENGTHS)}
    generated = run_mixed_schedule(harness, prompts, DECODE_STEPS, chunk="req3")
    layer = model.model.layers[1]
    weights = {name: (m.weight.view(torch.uint8).clone(), m.quant.weight_scale.clone())
               for name, m in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                               ("down", layer.mlp.down_proj))}
    return {"generated": generated, "logits": {r: harness.logits_of(r) for r in prompts}, "weights": weights}


def _rank_main(rank: int, init_file: str, out_dir: str, paths: dict[str, str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        parallel.init_tensor_parallel()
        for name, path in paths.items():
            torch.save(_run(path, WORLD_SIZE), Path(out_dir) / f"{name}.{rank}.pt")
    finally:
        parallel.reset_tensor_parallel()
        dist.destroy_process_group()


@functools.cache
def _tp_results() -> dict[str, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(str(Path(tmp) / "init"), tmp, _paths()), nprocs=WORLD_SIZE, join=True)
        return {name: [torch.load(Path(tmp) / f"{name}.{r}.pt") for r in range(WORLD_SIZE)] for name in _paths()}


@pytest.mark.parametrize("case", ["at-load", "ct-static"])
def test_tp2_fp8_matches_tp1(case):
    parallel.reset_tensor_parallel()
    single = _run(_paths()[case], tp=1)
    for rank, result in enumerate(_tp_results()[case]):
        # qkv at tp 1: q 64 rows, k 32, v 32 (4 query / 2 KV heads of 16); a rank keeps half of each.
        qkv, qkv_scale = single["weights"]["qkv"]
        q, kv = 64, 32
        keep = torch.cat([torch.arange(rank * q // 2, (rank + 1) * q // 2),
                          q + torch.arange(rank * kv // 2, (rank + 1) * kv // 2),
                          q + kv + torch.arange(rank * kv // 2, (rank + 1) * kv // 2)])
        got_qkv, got_qkv_scale = result["weights"]["qkv"]
        assert torch.equal(got_qkv, qkv[keep]) and torch.equal(got_qkv_scale, qkv_scale[keep])
        for name in ("o", "down"):
            weight, scale = single["weights"][name]
            cols = weight.shape[1] // WORLD_SIZE
            got_weight, got_scale = result["weights"][name]
            assert torch.equal(got_weight, weight[:, rank * cols : (rank + 1) * cols]), (name, rank)
            assert torch.equal(got_scale, scale), (name, rank)
        for req, logits in single["logits"].items():
            if case == "ct-static":
                # One static scale per input: every rank quantizes its slice as TP 1 does; only the
                # all-reduce's order of the partial sums differs.
                assert result["generated"][req] == single["generated"][req]
                torch.testing.assert_close(result["logits"][req], logits, rtol=1e-4, atol=1e-4)
            else:
                # Per-token scales over a slice: a rounding as large as FP8's own (see the float
                # comparison in test_fp8_checkpoints), on the prompt's positions.
                ref = logits[: len(logits) - DECODE_STEPS]
                got = result["logits"][req][: len(ref)]
                assert (got - ref).norm() / ref.norm() < 0.2, (rank, req)
