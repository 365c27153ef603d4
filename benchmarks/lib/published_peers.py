"""Throughput figures other engines publish, recorded beside raypaged's where a run has the same
workload: published, not measured in the run that records them (their hardware, software and
settings are theirs; the entry says what is known of them).

TensorRT-LLM's performance overview (its docs' `perf-overview.md`, "Throughput Measurements"):
Llama-3.1-8B FP8 (nvidia/Llama-3.1-8B-Instruct-FP8, ModelOpt), TP 1, ISL/OSL 1000/1000, metric
"Total Output Throughput (tokens/sec)": H200 SXM 141GB 17,744, H100 SXM 80GB 15,220. trtllm-bench
throughput, PyTorch backend, requests from `prepare_dataset.py token-norm-dist` (random ids, both
deviations 0), all queued at once; 3,000 requests for 1000/1000 (the page's table), CUDA graphs
padded to batch sizes up to 8,192, and "in many cases" 0.95 of free memory for the KV cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TRTLLM_PERF_OVERVIEW = "https://nvidia.github.io/TensorRT-LLM/performance/perf-overview.html"
TRTLLM_PERF_OVERVIEW_SOURCE = ("github.com/NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md "
                               "(commit 00f37686aa854010d68bcbd0f4ab000221541ca6, the v1.0 docs)")


@dataclass(frozen=True)
class PublishedThroughput:
    """One published offline-throughput figure and the workload it was measured on."""

    engine: str
    model: str
    precision: str  # the raypaged precision it stands beside
    gpu: str  # as it appears in torch.cuda.get_device_name(): "H200", "H100"
    tensor_parallel: int
    input_len: int
    output_len: int
    num_requests: int
    output_tokens_per_s: float
    source: str
    source_detail: str
    notes: str

    def record(self) -> dict:
        """The JSON record, marked as published and not measured here."""
        return {**asdict(self), "kind": "published", "measured_in_this_run": False}


def _trtllm_8b_fp8(gpu: str, output_tokens_per_s: float) -> PublishedThroughput:
    return PublishedThroughput(
        engine="TensorRT-LLM", model="Llama-3.1-8B-Instruct-FP8 (nvidia, ModelOpt)", precision="fp8", gpu=gpu,
        tensor_parallel=1, input_len=1000, output_len=1000, num_requests=3000,
        output_tokens_per_s=output_tokens_per_s, source=TRTLLM_PERF_OVERVIEW,
        source_detail=TRTLLM_PERF_OVERVIEW_SOURCE,
        notes="trtllm-bench throughput, PyTorch backend, all requests queued at once; CUDA graph batch "
              "sizes padded up to 8,192; KV cache often at 0.95 of free memory")


PUBLISHED: tuple[PublishedThroughput, ...] = (_trtllm_8b_fp8("H200", 17744.0), _trtllm_8b_fp8("H100", 15220.0))


def published_for(input_len: int, output_len: int, device_name: str) -> list[PublishedThroughput]:
    """The published figures of this fixed workload: the one on this run's GPU first (the
    comparable one), then the others. Empty for a workload none was published on."""
    same = [p for p in PUBLISHED if (p.input_len, p.output_len) == (input_len, output_len)]
    return sorted(same, key=lambda p: p.gpu not in device_name)
