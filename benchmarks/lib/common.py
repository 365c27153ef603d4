"""What every benchmark shares: the environment record, the copy-bandwidth ceiling, CUDA-graph
timing, JSON output, the random-weights Llama shapes, and transformers' model built on those
shapes.

Results go to `benchmarks/results/` unless a benchmark's --out (the device runner passes $OUT)
or RAYPAGED_RESULTS_DIR says otherwise."""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"
# The H200's L2. Timed calls rotate over enough distinct inputs that >= 4x this is read, so a
# timing reads HBM, not the previous call's leftovers in L2.
L2_BYTES = 60 * 2**20

# Llama shapes run with random weights (load_format "dummy"): no checkpoint to download.
SHAPES = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
               "max_position_embeddings": 8192, "rope_theta": 500000.0},
    # The same model with Llama 3.1's longer context, capped at 32k: what the contiguous
    # reservation mode reserves per request when a server offers a long-context model's window.
    "8b-32k": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                   "max_position_embeddings": 32768, "rope_theta": 500000.0},
    # Llama-3-70B's shape: 141 GB of bf16 weights, so one H200 cannot hold it (bench_tp.py
    # skips that TP size); from TP=2 up, 70.6 GB or less per GPU.
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                "max_position_embeddings": 8192, "rope_theta": 500000.0},
    "tiny": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                 "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 4096,
                 "max_position_embeddings": 2048, "rope_theta": 10000.0},
    # The 8B-class shapes of the other families (issue 21's byte-floor runs), as their
    # config.json files give them; dummy weights.
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
                 "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "gemma2-9b": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
                  "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
                  "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
                  "max_position_embeddings": 8192, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                  "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                  "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                  "sliding_window": 4096, "tie_word_embeddings": True},
    "phi3-medium": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 5120,
                    "intermediate_size": 17920, "num_hidden_layers": 40, "num_attention_heads": 40,
                    "num_key_value_heads": 10, "vocab_size": 32064, "max_position_embeddings": 4096,
                    "rope_theta": 10000.0},
}


def log(*args: object) -> None:
    """print, flushed: a GPU run's log shows each step as it happens."""
    print(*args, flush=True)


def shape_config(shape: str, **fields: object) -> dict:
    """The config.json fields of `shape`: Llama's unless the shape names its family."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
            **SHAPES[shape], **fields}


def write_config(shape: str, dtype: str, directory: Path) -> Path:
    """A config.json of `shape` in `directory`, which then loads with load_format="dummy"."""
    config = shape_config(shape, torch_dtype=dtype)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def decode_setup(shape: str, batch_sizes: str) -> tuple[torch.device, str, int, list[int]]:
    """What a decode benchmark starts from: the device (CUDA if any), its dtype name (bf16 on
    CUDA, fp32 on CPU), the shape's vocabulary size and the --batch-sizes list."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    return device, dtype_name, SHAPES[shape]["vocab_size"], [int(b) for b in batch_sizes.split(",")]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_random_model(model_dir: Path, dtype: torch.dtype, device: torch.device):
    """transformers' own model of the config in `model_dir`, random weights, EOS cleared so that
    generate always runs to max_new_tokens (as the engine's ignore_eos)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    return model


def release_memory(device: torch.device) -> None:
    """Give back what dropped models and engines held. The engine freezes the collector
    (gc.freeze) after start-up, so cycles made before that are only found once unfrozen."""
    gc.unfreeze()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def environment() -> dict:
    """Commit, device and versions. On the GPU machine the tree has no .git: the launching
    command passes the commit in RAYPAGED_COMMIT."""
    commit = os.environ.get("RAYPAGED_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                                    cwd=RESULTS.parent, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    import transformers
    import triton

    return {
        "commit": commit,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        # Programmatic dependent launch of the Triton kernels (raypaged/kernels/pdl.py), when asked for.
        "raypaged_pdl": os.environ.get("RAYPAGED_PDL", "1"),
    }


def device_tag() -> str:
    """The GPU's short name for result files ("h200"), or "cpu"."""
    return torch.cuda.get_device_name().split()[-1].lower() if torch.cuda.is_available() else "cpu"


def add_replot_argument(parser) -> None:
    parser.add_argument("--replot", type=Path, default=None,
                        help="only redraw the PNG of a saved JSON (no GPU needed)")


def replot(path: Path, plot) -> int:
    """--replot: plot(the saved result, the PNG beside it)."""
    plot(json.loads(path.read_text()), path.with_suffix(".png"))
    return 0


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Device-to-device copy, bytes read + written per second (median of CUDA-event timings).

    bf16 elements: a copy of 1-byte elements reads slower than the card can (benchmarks/README.md,
    history), and the floor must use what the card can do."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    if device.type != "cuda":
        import time

        times = []
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return 2 * nbytes / sorted(times)[2]
    for _ in range(5):
        dst.copy_(src)
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def pinned_copy_bandwidth(nbytes: int = 2**28, repeats: int = 10) -> dict[str, float]:
    """Host-device copy bandwidth through pinned memory on this process's CUDA device, GB/s each
    way (median of CUDA-event timings): the ceiling of the host tier's transfers."""
    device = torch.device("cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {}
    for name, dst, src in (("host_to_device", gpu, host), ("device_to_host", host, gpu)):
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        result[name] = nbytes / sorted(times)[len(times) // 2] / 1e9
    del host, gpu
    torch.cuda.empty_cache()
    return result


def graph_time(fn: Callable[[int], object], variants: int, calls: int = 20, replays: int = 25) -> float:
    """Seconds per fn(i) call, as a server launches it: `calls` calls (cycling i over `variants`)
    captured in one CUDA graph, the median of `replays` replays."""
    # Warm up (compile, autotune, workspaces) on a side stream, as graph capture requires.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(variants):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % variants)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(times)


def write_json(name: str, result: dict, out_dir: Path | None = None) -> Path:
    out_dir = Path(out_dir or os.environ.get("RAYPAGED_RESULTS_DIR") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
