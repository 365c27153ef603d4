"""Paged attention kernels against FlashInfer, torch SDPA and the card's copy bandwidth: every
implementation checked on the tensors it is timed on, then timed, in one run.

    python -m benchmarks.bench_kernels [--cases NAME,...] [--peers flashinfer,sdpa] [--out DIR]  # GPU
    python -m benchmarks.bench_kernels --tune decode,prefill --cases NAME   # also sweep raypaged's configs
    TRITON_INTERPRET=1 python -m benchmarks.bench_kernels --smoke --out /tmp/k  # CPU: the code paths
    python -m benchmarks.bench_kernels --replot benchmarks/results/kernels_h200.json

Cases (benchmarks/lib/attention_cases.py): decode in bf16 on uniform batches and on mixed-length
batches drawn with fixed seeds, over GQA group, head dim and block size; prefill on fresh
sequences and on batches extending a cached prefix. Implementations: raypaged's
paged_decode_triton / paged_prefill_triton with their defaults; FlashInfer's
BatchDecodeWithPagedKVCacheWrapper (CUDA-core and tensor-core kernels) and
BatchPrefillWithPagedKVCacheWrapper on the same pool and block tables; torch SDPA on contiguous
copies of the same K/V where one dense tensor holds the batch (uniform decode, fresh prefill).

Correctness first: each implementation's output over every rotation variant it is timed on,
against the fp32 reference (raypaged.kernels.testing.check_against_reference), with NaN in every
slot it must not read. One that raises or fails is recorded so (status "error" / "wrong") and has
no time. Timing: decode as CUDA-graph replays of 20 calls rotating over enough distinct batches
that >= 4x L2 is read (FlashInfer's wrappers in their CUDA-graph mode, planned once per batch
outside the graph); prefill with triton.testing.do_bench (L2 flushed between calls) for every
implementation. FlashInfer compiles its modules in one build before any case runs.
Figures per case and the issue's targets: benchmarks/lib/attention_report.py. Writes
kernels_<device>.json (after every case, so a run cut short keeps what it measured) and .png
under --out; prints a table last. --smoke: tiny cases on the CPU interpreter, one call per
"timing", no FlashInfer; checks the benchmark's code, measures nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from triton.testing import do_bench

from benchmarks.lib import common
from benchmarks.lib.attention_cases import (
    DECODE_CASES,
    PREFILL_CASES,
    SMOKE_DECODE_CASES,
    SMOKE_PREFILL_CASES,
    DecodeBatch,
    DecodeCase,
    Kernel,
    PrefillBatch,
    PrefillCase,
)
from benchmarks.lib.attention_peers import FlashInfer, sdpa_decode, sdpa_prefill
from benchmarks.lib.attention_report import PEERS, TARGETS, add_figures, plot, table, targets_met
from benchmarks.lib.common import log
from raypaged.kernels.paged_decode import TARGET_PROGRAMS_PER_SM, paged_decode_triton, plan_work
from raypaged.kernels.paged_prefill import CUDA_DEFAULT as PREFILL_VARIANT
from raypaged.kernels.paged_prefill import default_launch_config as prefill_launch_config
from raypaged.kernels.paged_prefill import paged_prefill_triton
from raypaged.kernels.testing import check_against_reference
from raypaged.kernels.triton_common import num_sms

DTYPE = torch.bfloat16
DECODE_SWEEP = [{"tile_n": t, "num_warps": w, "num_stages": s} for t in (32, 64, 128) for w in (4, 8)
                for s in (2, 3, 4)]
# Work items per SM the plan aims for (--tune decode): the default and around it.
PROGRAMS_PER_SM_SWEEP = (2, TARGET_PROGRAMS_PER_SM, 8, 16)
PREFILL_SWEEP = [
    {"block_m": m, "block_n": n, "num_warps": w, "num_stages": s, "pack_gqa": pack}
    for m, n, w, s, pack in [(128, 128, 8, 3, False), (128, 64, 4, 3, False), (128, 64, 4, 4, False),
                             (128, 32, 4, 4, False), (128, 64, 4, 2, False), (64, 128, 4, 3, False),
                             (128, 128, 8, 3, True), (128, 64, 8, 3, True), (128, 64, 4, 3, True),
                             (64, 64, 4, 3, True), (128, 32, 4, 4, True), (256, 64, 8, 2, True)]
]


class Timer:
    """Seconds per call of a kernel. On a GPU: decode by common.graph_time, prefill by do_bench's
    median.
    --smoke: the wall time of one call, which proves the path runs and measures nothing."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke

    def __call__(self, kernel: Kernel, variants: int, section: str) -> float:
        if self.smoke:
            start = time.perf_counter()
            kernel.run(0)
            return time.perf_counter() - start
        if section == "decode":
            return common.graph_time(kernel.run, variants)
        return do_bench(lambda: kernel.run(0), warmup=50, rep=400, return_mode="median") / 1e3


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def measure(build: Callable[[], Kernel], batch: DecodeBatch | PrefillBatch, timer: Timer, section: str) -> dict:
    """Check one implementation on every variant of the batch, then time it. A build or call that
    raises is status "error", a wrong output "wrong"; neither gets a time."""
    try:
        kernel = build()
        batch.out.fill_(float("nan"))  # what an implementation leaves unwritten fails the check
        out = torch.cat([kernel.to_tokens(kernel.run(i)) for i in range(batch.variants)])
    except Exception as exc:  # noqa: BLE001 - recorded; the other implementations still run
        return {"status": "error", "detail": error_text(exc)}
    try:
        row: dict = {"max_rel_err": check_against_reference(out, batch.reference, batch.dtype)}
    except AssertionError as exc:
        return {"status": "wrong", "detail": str(exc)}
    try:
        row["seconds"] = timer(kernel, batch.variants, section)
    except Exception as exc:  # noqa: BLE001
        return {**row, "status": "error", "detail": "timing: " + error_text(exc)}
    return {"status": "ok", **row}


def raypaged_decode(batch: DecodeBatch, target_items: int | None = None, **config: Any) -> Kernel:
    """The decode kernel and its merge on each variant's work list, planned once per variant
    outside the timing (the engine plans once a step for every layer; FlashInfer's plan is
    outside its timing too)."""
    p = batch.paged
    works = [plan_work(p.seq_lens[batch.rows(i)], p.k_cache.shape[2], target_items=target_items,
                       align=config.get("tile_n")) for i in range(batch.variants)]

    def run(i: int) -> torch.Tensor:
        rows = batch.rows(i)
        return paged_decode_triton(batch.q[rows], p.k_cache, p.v_cache, p.block_tables[rows], p.seq_lens[rows],
                                   batch.scale, out=batch.out[rows], work=works[i], **config)

    return Kernel(run)


def raypaged_prefill(batch: PrefillBatch, **config: Any) -> Kernel:
    # The step's own k/v, as the attention layer passes them: the default config decides whether
    # the new tokens are read from them or through the block table.
    return Kernel(lambda i: paged_prefill_triton(batch.q, *batch.args, out=batch.out, k_new=batch.k_new,
                                                 v_new=batch.v_new, **config))


TIMING = {
    "decode": "CUDA-graph replays of 20 calls, rotating over `variants` distinct batches (>= 4x L2 of K/V), "
              "median of 25 replays; raypaged's decode and merge kernels on a work list planned once per batch "
              "outside the graph (as the engine plans once a step for all layers); FlashInfer's wrappers in "
              "CUDA-graph mode (use_cuda_graph=True), planned once per batch outside the graph",
    "prefill": "triton.testing.do_bench median (L2 flushed between calls), every implementation",
    "bytes": "decode: K and V of every context token once + q and out once + block-table entries and lengths",
}


class Bench:
    """One run: its settings, its peers and the result being built."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.device, self.smoke = device, args.smoke
        self.timer = Timer(args.smoke)
        self.tune = set(filter(None, args.tune.split(",")))
        self.sdpa = "sdpa" in args.peers.split(",")
        self.flashinfer: FlashInfer | None = None
        reason = "not asked for (--peers)"
        if "flashinfer" in args.peers.split(",") and not args.smoke:
            self.flashinfer, reason = FlashInfer.load(device)
        elif args.smoke:
            reason = "--smoke"
        self.flashinfer_note = reason  # its version, or why it is absent
        env = common.environment()
        if device.type == "cuda":
            env.update(cuda=torch.version.cuda, sm_count=torch.cuda.get_device_properties(device).multi_processor_count)
        self.result: dict = {"env": env, "args": {k: str(v) for k, v in vars(args).items()},
                             "mode": "smoke" if args.smoke else "compare",
                             "flashinfer": reason, "targets": TARGETS, "timing": TIMING, "decode": [],
                             "prefill": [], "errors": []}

    def not_measured(self, peer: str, inapplicable: str) -> dict:
        """The entry of a peer not run: absent (FlashInfer not importable, or left out by --peers),
        or n/a (SDPA on a batch one dense tensor cannot hold)."""
        if peer == "flashinfer":
            return {"status": "absent", "detail": self.flashinfer_note}
        if not self.sdpa:
            return {"status": "absent", "detail": "not asked for (--peers)"}
        return {"status": "n/a", "detail": inapplicable}

    def decode(self, case: DecodeCase, copy_bw: float) -> dict:
        batch = DecodeBatch(case, DTYPE, self.device, rotate=not self.smoke)
        impls: dict[str, dict] = {}
        impls["raypaged"] = measure(partial(raypaged_decode, batch), batch, self.timer, "decode")
        for layout in PEERS["decode"]["sdpa"]:
            impls[layout] = (measure(partial(sdpa_decode, batch, layout), batch, self.timer, "decode")
                             if self.sdpa and case.uniform else self.not_measured("sdpa", "mixed lengths"))
        for name, tensor_cores in (("flashinfer_decode", False), ("flashinfer_decode_tc", True)):
            impls[name] = (measure(partial(self.flashinfer.decode, batch, tensor_cores), batch, self.timer, "decode")
                           if self.flashinfer else self.not_measured("flashinfer", ""))
        if "decode" in self.tune and impls["raypaged"]["status"] == "ok":
            impls["raypaged"]["sweep"] = [
                {"config": config, **measure(partial(raypaged_decode, batch, **config), batch, self.timer, "decode")}
                for config in DECODE_SWEEP]
        if self.tune & {"decode", "target"} and impls["raypaged"]["status"] == "ok":
            sms = num_sms(self.device)
            impls["raypaged"]["target_sweep"] = [
                {"programs_per_sm": per_sm,
                 **measure(partial(raypaged_decode, batch, target_items=max(per_sm * sms // case.num_kv_heads, 1)),
                           batch, self.timer, "decode")}
                for per_sm in PROGRAMS_PER_SM_SWEEP]
        row = {**case.describe(DTYPE.itemsize), "variants": batch.variants, "impls": impls}
        add_figures(row, "decode", copy_bw)
        return row

    def prefill(self, case: PrefillCase, copy_bw: float) -> dict:
        batch = PrefillBatch(case, DTYPE, self.device)
        impls: dict[str, dict] = {}
        impls["raypaged"] = measure(partial(raypaged_prefill, batch), batch, self.timer, "prefill")
        for layout in PEERS["prefill"]["sdpa"]:
            impls[layout] = (measure(partial(sdpa_prefill, batch, layout), batch, self.timer, "prefill")
                             if self.sdpa and case.fresh_uniform
                             else self.not_measured("sdpa", "a cached prefix or mixed lengths"))
        impls["flashinfer_prefill"] = (measure(partial(self.flashinfer.prefill, batch), batch, self.timer, "prefill")
                                       if self.flashinfer else self.not_measured("flashinfer", ""))
        if "prefill" in self.tune and impls["raypaged"]["status"] == "ok":
            impls["raypaged"]["sweep"] = [
                {"config": config, **measure(partial(raypaged_prefill, batch, **config), batch, self.timer,
                                             "prefill")} for config in PREFILL_SWEEP]
        row = {**case.describe(), "variant": PREFILL_VARIANT,
               "config": prefill_launch_config(case.head_dim, DTYPE, self.device), "impls": impls}
        add_figures(row, "prefill", copy_bw)
        return row

    def prebuild_flashinfer(self, decode: list[DecodeCase], prefill: list[PrefillCase]) -> None:
        """Compile FlashInfer's modules before any timing; if the one-build path fails, each
        wrapper compiles its module at its first plan() (before its own check, still untimed)."""
        if self.flashinfer is None:
            return
        info: dict = {}
        try:
            info["prefill_backend"] = self.flashinfer.prefill_backend(DTYPE)
            info["compile_s"] = self.flashinfer.prebuild({c.head_dim for c in decode},
                                                         {c.head_dim for c in prefill}, DTYPE)
        except Exception as exc:  # noqa: BLE001 - the wrappers then compile on first use
            info["prebuild_error"] = error_text(exc)
        self.result["flashinfer_build"] = info
        log("FlashInfer build:", info)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--peers", default="flashinfer,sdpa", help="which peers to measure")
    parser.add_argument("--tune", default="", help="also sweep raypaged's launch configs of: decode,prefill; "
                        "target: only decode's work items per SM")
    parser.add_argument("--smoke", action="store_true", help="tiny cases on the CPU interpreter (no timing)")
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    common.add_replot_argument(parser)
    args = parser.parse_args(argv)
    if args.replot:
        return common.replot(args.replot, plot)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        log("needs a CUDA device (or --smoke)")
        return 2
    all_decode = SMOKE_DECODE_CASES if args.smoke else DECODE_CASES
    all_prefill = SMOKE_PREFILL_CASES if args.smoke else PREFILL_CASES
    known = {c.name for c in all_decode} | {c.name for c in all_prefill}
    wanted = set(filter(None, args.cases.split(",")))
    if wanted - known:
        log(f"unknown cases {sorted(wanted - known)}; cases: {sorted(known)}")
        return 2
    decode = [c for c in all_decode if not wanted or c.name in wanted]
    prefill = [c for c in all_prefill if not wanted or c.name in wanted]

    run_start = time.perf_counter()
    torch.manual_seed(0)
    bench = Bench(args, device)
    result = bench.result
    log(result["env"])
    copy_bw = common.copy_bandwidth(device, nbytes=2**30 if device.type == "cuda" else 2**22)
    result["copy_TBps"] = copy_bw / 1e12
    log(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "kernels_smoke_cpu" if args.smoke else f"kernels_{common.device_tag()}"
    json_path = args.out / f"{stem}.json"
    bench.prebuild_flashinfer(decode, prefill)

    jobs: list[tuple[str, str, Callable[[], dict]]] = [
        *[("decode", c.name, partial(bench.decode, c, copy_bw)) for c in decode],
        *[("prefill", c.name, partial(bench.prefill, c, copy_bw)) for c in prefill]]
    for section, name, job in jobs:
        start = time.perf_counter()
        try:
            row = job()
            row["elapsed_s"] = time.perf_counter() - start
            result[section].append(row)
            log(section, name, {n: {k: v for k, v in i.items() if k != "sweep"} for n, i in row["impls"].items()})
        except Exception as exc:  # noqa: BLE001 - keep what was measured; record what failed
            result["errors"].append(f"{section} {name}: {error_text(exc)}")
            log("FAILED", result["errors"][-1])
        if device.type == "cuda":
            torch.cuda.empty_cache()
        json_path.write_text(json.dumps(result, indent=1))  # progress survives a later crash

    result["targets_met"] = targets_met(result)
    failed = [{"case": r["name"], "impl": name, "status": impl["status"], "detail": impl.get("detail")}
              for section in ("decode", "prefill") for r in result[section]
              for name, impl in r["impls"].items() if impl["status"] in ("error", "wrong")]
    result["failed_implementations"] = failed
    result["elapsed_s"] = time.perf_counter() - run_start
    json_path.write_text(json.dumps(result, indent=1))
    try:
        plot(result, json_path.with_suffix(".png"))
    except Exception as exc:  # noqa: BLE001 - the JSON is what counts
        result["errors"].append(f"plot: {error_text(exc)}")
        json_path.write_text(json.dumps(result, indent=1))
    for line in table(result) + [f"FAILED {f}" for f in failed] + [f"ERROR {e}" for e in result["errors"]]:
        log(line)
    # A peer that cannot run a shape (it raises) is a finding; a wrong output, or raypaged failing, is not.
    broken = [f for f in failed if f["impl"] == "raypaged" or f["status"] == "wrong"]
    return 1 if result["errors"] or broken else 0


if __name__ == "__main__":
    sys.exit(main())
