"""What FP8 costs in quality (issue 22): perplexity on held-out text and greedy agreement with the
unquantized model, for FP8 weights, an FP8 KV cache, and both, on the trained demo model.

    python -m benchmarks.bench_quality              # CPU: fp32 baseline, a part of the text
    bash scripts/gpu.sh quality                     # the H200: bf16 baseline, all of it

Every mode is the same checkpoint through raypaged's engine (`LLM`), one engine after another:
  auto         the model's dtype on this device (fp32 on CPU, bf16 on CUDA): the baseline
  bf16 / fp32  the other float dtype, for scale: what rounding alone moves
  fp8-weights  --quantization fp8: e4m3 weights quantized at load, per-output-channel scales
  fp8-kv       --kv-cache-dtype fp8: e4m3 K/V in the pool (scale 1.0: the demo has no calibrated
               k/v scales)
  fp8          both
On CPU the FP8 paths are the dequantized references (W8A8 with per-token activation scales; the
KV write quantizes, attention widens); on CUDA the real kernels, with CUDA graphs.

Measures, each against the first mode (benchmarks/lib/quality.py):
  - perplexity over --windows consecutive windows of --window tokens of the held-out stdlib files
    (text the demo never trained on), from the engine's prompt logprobs; its change against the
    baseline, the share of positions where both predict the same top-1 token, the mean absolute
    difference of the text's token logprobs;
  - greedy agreement: --prompts prompts of --prompt-len tokens cut from the held-out stream, each
    continued greedily for --max-tokens tokens; per prompt the first position where the output
    leaves the baseline's, and over all tokens the share before those points and the share of
    positions holding the same token.
Writes benchmarks/results/quality_<model>_<device>.json and a PNG beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.lib import quality
from benchmarks.lib.common import add_replot_argument, device_tag, environment, log, release_memory, replot, write_json
from raypaged import LLM
from raypaged.demo import demo_model_path

MODES: dict[str, dict[str, str]] = {
    "auto": {},
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "fp8-weights": {"quantization": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def default_modes(cuda: bool) -> str:
    return "auto,fp32,fp8-weights,fp8-kv,fp8" if cuda else "auto,bf16,fp8-weights,fp8-kv,fp8"


def greedy_prompts(stream: list[int], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens spread evenly over the stream."""
    step = (len(stream) - length) // count
    if step <= 0:
        raise ValueError(f"a stream of {len(stream)} tokens cannot give {count} prompts of {length}")
    return [stream[i * step : i * step + length] for i in range(count)]


def run_mode(model: str, settings: dict, chunks: list[list[int]], prompts: list[list[int]],
             max_tokens: int, engine_kwargs: dict) -> tuple[quality.Scores, list[list[int]], dict]:
    """One engine of the mode's settings: the windows' scores, the prompts' greedy outputs and
    what the run took."""
    llm = LLM(model, skip_tokenizer_init=True, **engine_kwargs, **settings)
    try:
        started = time.perf_counter()
        scores = quality.score(llm, chunks)
        scored = time.perf_counter()
        outputs = quality.greedy(llm, prompts, max_tokens)
        done = time.perf_counter()
        facts = {"score_s": round(scored - started, 2), "greedy_s": round(done - scored, 2)}
    finally:
        llm.shutdown()
    return scores, outputs, facts


def measure(args: argparse.Namespace, save: Callable[[dict], object]) -> dict:
    """Every mode's measures; `save` gets the result after each mode (a run cut short by its
    time limit keeps the modes it finished: "complete" says whether all ran)."""
    from transformers import AutoTokenizer

    model_dir = Path(args.model)
    texts = quality.read_texts(quality.held_out_files(model_dir))
    stream = quality.token_stream(AutoTokenizer.from_pretrained(model_dir), texts)
    chunks = quality.windows(stream, args.window, args.windows)
    prompts = greedy_prompts(stream, args.prompts, args.prompt_len)
    cuda = torch.cuda.is_available()
    modes = (args.modes or default_modes(cuda)).split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    engine_kwargs = {"max_model_len": max(args.window + 1, args.prompt_len + args.max_tokens),
                     "max_num_seqs": args.max_num_seqs}
    result: dict = {
        "env": environment(), "model": str(model_dir), "modes": modes, "baseline": modes[0],
        "text": {"held_out_tokens": len(stream), "digest": quality.text_digest(texts),
                 "window": args.window, "windows": len(chunks)},
        "greedy": {"prompts": len(prompts), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens},
        "engine": engine_kwargs, "complete": False, "results": {},
    }
    base_scores: quality.Scores | None = None
    base_outputs: list[list[int]] | None = None
    for mode in modes:
        log(f"== {mode}: {MODES[mode] or 'the model dtype'}")
        scores, outputs, facts = run_mode(str(model_dir), MODES[mode], chunks, prompts, args.max_tokens,
                                          engine_kwargs)
        entry = {"settings": MODES[mode], "perplexity": scores.perplexity(),
                 "scored_tokens": scores.num_tokens, **facts}
        if base_scores is None:
            base_scores, base_outputs = scores, outputs
        else:
            assert base_outputs is not None
            entry.update(quality.scores_against(base_scores, scores))
            entry["greedy"] = quality.greedy_agreement(base_outputs, outputs)
        result["results"][mode] = entry
        result["complete"] = mode == modes[-1]
        save(result)
        log(f"   perplexity {entry['perplexity']:.3f}"
            + (f" ({entry['perplexity_change']:+.2%}), top-1 {entry['top1_agreement']:.2%}, greedy prefix "
               f"{entry['greedy']['prefix_agreement']:.2%} / positional {entry['greedy']['positional_agreement']:.2%}"
               if "greedy" in entry else "") + f"  [{facts['score_s']} + {facts['greedy_s']} s]")
        release_memory(torch.device("cuda" if cuda else "cpu"))
    return result


def save_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result["modes"]
    others = modes[1:]
    fig, (ppl, agree) = plt.subplots(1, 2, figsize=(13, 4.5))
    values = [result["results"][m]["perplexity"] for m in modes]
    ppl.bar(modes, values, color=["tab:gray"] + ["tab:blue"] * len(others))
    for x, m in enumerate(modes):
        change = result["results"][m].get("perplexity_change")
        label = f"{values[x]:.2f}" + (f"\n{change:+.2%}" if change is not None else "\nbaseline")
        ppl.text(x, values[x], label, ha="center", va="bottom", fontsize=8)
    ppl.set_ylim(0, max(values) * 1.2)
    ppl.set_ylabel("perplexity")
    ppl.set_title(f"held-out perplexity, {result['results'][modes[0]]['scored_tokens']:,} tokens "
                  f"({result['env']['device']})")
    width = 0.27
    measures = (("top1_agreement", "top-1 on the text (teacher-forced)"),
                ("positional_agreement", "greedy: same token at a position"),
                ("prefix_agreement", "greedy: before first divergence"))
    for i, (key, label) in enumerate(measures):
        heights = [result["results"][m][key] if key == "top1_agreement" else result["results"][m]["greedy"][key]
                   for m in others]
        agree.bar([x + (i - 1) * width for x in range(len(others))], heights, width, label=label)
    agree.set_xticks(range(len(others)), others)
    agree.set_ylim(0, 1.05)
    agree.set_ylabel(f"share of tokens, against {modes[0]}")
    agree.set_title(f"agreement, greedy over {result['greedy']['prompts']} x {result['greedy']['max_tokens']} tokens")
    agree.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=demo_model_path(),
                        help="a checkpoint with a training_info.json naming its held-out files (default: the demo)")
    parser.add_argument("--modes", default=None, help=f"comma-separated, the first the baseline; of {', '.join(MODES)} "
                        "(default: auto, the other float dtype, fp8-weights, fp8-kv, fp8)")
    parser.add_argument("--window", type=int, default=128, help="tokens a window (the demo trained on 128)")
    parser.add_argument("--windows", type=int, default=None, help="default: all on CUDA, 256 on CPU")
    parser.add_argument("--prompts", type=int, default=None, help="default: 32 on CUDA, 16 on CPU")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 256 on CUDA, 128 on CPU")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch threads on CPU (a small shared machine runs faster on one)")
    parser.add_argument("--out", type=Path, default=None)
    add_replot_argument(parser)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.windows is None and not cuda:
        args.windows = 256
    args.prompts = args.prompts or (32 if cuda else 16)
    args.max_tokens = args.max_tokens or (256 if cuda else 128)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot, save_plot)
    if not torch.cuda.is_available():
        torch.set_num_threads(args.cpu_threads)
    name = f"quality_{Path(args.model).name.removesuffix('_model')}_{device_tag()}"
    result = measure(args, lambda partial: write_json(name, partial, args.out))
    path = write_json(name, result, args.out)
    save_plot(result, path.with_suffix(".png"))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
