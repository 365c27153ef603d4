#!/usr/bin/env python
"""Build raypaged's built-in demo model: a tiny Llama trained on Python's own standard library.

    python scripts/make_demo_model.py --out raypaged/demo_model [--steps 1000] [--seed 0]

Everything is made here, offline, and seeded:

1. Corpus: the top-level ``*.py`` files of the running interpreter's stdlib
   (``sysconfig.get_paths()["stdlib"]``), sorted by name, minus the build-generated
   ``_sysconfigdata_*.py``. A file is held out for evaluation when
   ``crc32(name) % 10 == 0`` - a rule on the name rather than on a position in the list, so the
   split stays put when another Python version adds or drops modules.
2. Tokenizer: byte-level BPE (code-aware pre-tokenisation, see CODE_SPLIT_PATTERN; all 256
   bytes in the base alphabet so any UTF-8 round-trips) trained with the ``tokenizers`` library,
   wrapped as a ``PreTrainedTokenizerFast`` with ``<s>``/``</s>`` and a post-processor that prepends ``<s>``.
3. Model: ``LlamaForCausalLM`` (GQA, tied embeddings) trained with a plain AdamW loop for a fixed
   number of steps on random windows of the tokenised training files, each file framed as
   ``<s> text </s>``, under bf16 autocast. Fixed steps (not a time budget) so the result depends
   only on the seed, the thread count, the corpus and the library versions: two short runs here gave
   byte-identical weights. The default 1000 steps of 8x128 tokens take about 3 minutes on two
   otherwise idle cores (about 0.18 s a step); the committed run's ``train_seconds`` is far
   larger because its two cores were shared with other work.
4. Saved with ``save_pretrained(safe_serialization=True)`` in bfloat16, plus ``training_info.json``
   (corpus files, held-out files, loss curve, versions) documenting how it was made.

The stdlib differs slightly between Python versions, so rerunning elsewhere gives a similar, not
byte-identical, model: the committed artifact is the reference; this script records its recipe.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
HELD_OUT_MODULUS = 10
# Pre-tokenisation for code. GPT-2's pattern glues a space to the *next* word, so a prompt that
# ends in a space ("def ", "import ") ends in a lone-space token the model rarely saw. Here a
# word or punctuation run keeps its *trailing* space ("def ", ", ", "= "), and a newline keeps the
# indentation after it ("\n        "), so the demo's natural prompts tokenize as training text did.
CODE_SPLIT_PATTERN = r"[\p{L}_][\p{L}\p{N}_]* ?|\p{N}{1,3} ?|[^\s\p{L}\p{N}_]+ ?|\s*\n[ \t]*|\s+"


@dataclass(frozen=True)
class DemoRecipe:
    """Every knob that shapes the artifact; written into training_info.json."""

    vocab_size: int = 3072
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 768
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 128
    peak_lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 2


def stdlib_python_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    # _sysconfigdata_*.py is written when Python is built: a dict of this machine's build flags
    # and paths, not source code, and large enough to teach the model to emit 'HAVE_...': 1.
    return sorted(p for p in stdlib.glob("*.py") if p.is_file() and not p.name.startswith("_sysconfigdata"))


def is_held_out(path: Path) -> bool:
    return zlib.crc32(path.name.encode()) % HELD_OUT_MODULUS == 0


def read_text(path: Path) -> str:
    # A handful of stdlib files are Latin-1; replacing undecodable bytes keeps the corpus text.
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CODE_SPLIT_PATTERN), behavior="isolated"),
        # Bytes to printable symbols only; the split above already chose the pieces.
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    bos_id = bpe.token_to_id(BOS_TOKEN)
    # Prompts get <s> in front, as Llama tokenizers do, matching how training documents start.
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        # Default cleanup rewrites " ." and friends, which breaks exact round-trips of code.
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )


def build_config(recipe: DemoRecipe, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=recipe.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )


def tokenize_corpus(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """One long stream of ``<s> file </s>`` documents."""
    ids: list[int] = []
    # verbose=False: files are longer than model_max_length, which is expected here.
    for doc in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        ids.append(tokenizer.bos_token_id)
        ids.extend(doc)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def learning_rate(step: int, recipe: DemoRecipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.peak_lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return recipe.min_lr + (recipe.peak_lr - recipe.min_lr) * cosine


def random_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, stream: torch.Tensor, length: int, max_windows: int) -> float:
    """Mean next-token loss over consecutive, non-overlapping windows of ``stream``."""
    count = min(max_windows, stream.numel() // length)
    if count == 0:
        raise ValueError(f"evaluation stream of {stream.numel()} tokens is shorter than {length}")
    windows = stream[: count * length].view(count, length)
    model.eval()
    loss = model(input_ids=windows, labels=windows).loss.item()
    model.train()
    return loss


def train(model: LlamaForCausalLM, train_ids: torch.Tensor, recipe: DemoRecipe) -> list[dict[str, float]]:
    """Plain AdamW loop on fp32 master weights; returns the logged loss curve."""
    gen = torch.Generator().manual_seed(recipe.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.peak_lr,
        betas=(0.9, 0.95),
    )
    curve: list[dict[str, float]] = []
    log_every = max(1, recipe.steps // 20)
    started = time.perf_counter()
    model.train()
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, recipe)
        batch = random_windows(train_ids, recipe.batch_size, recipe.seq_len, gen)
        # bf16 autocast roughly halves step time on CPUs with AVX512-BF16; weights stay fp32.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        if step % log_every == 0 or step == recipe.steps - 1:
            elapsed = round(time.perf_counter() - started, 1)
            point = {"step": step, "train_loss": round(loss.item(), 4), "seconds": elapsed}
            curve.append(point)
            print(json.dumps(point), flush=True)
    return curve


def name_tokenizer_class_portably(tokenizer_config: Path) -> None:
    """transformers 5 writes its new class name, TokenizersBackend, which 4.x cannot resolve;
    PreTrainedTokenizerFast resolves to the same thing in 5.x and is understood by 4.x."""
    data = json.loads(tokenizer_config.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config.write_text(json.dumps(data, indent=2) + "\n")


def sample_continuation(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=48, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def build(out_dir: Path, recipe: DemoRecipe) -> dict:
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    files = stdlib_python_files()
    train_files = [p for p in files if not is_held_out(p)]
    held_out_files = [p for p in files if is_held_out(p)]
    if not train_files or not held_out_files:
        raise RuntimeError(f"stdlib at {sysconfig.get_paths()['stdlib']} gave no usable .py files")
    train_texts = [read_text(p) for p in train_files]
    held_out_texts = [read_text(p) for p in held_out_files]

    tokenizer = train_tokenizer(train_texts, recipe.vocab_size)
    train_ids = tokenize_corpus(tokenizer, train_texts)
    eval_ids = tokenize_corpus(tokenizer, held_out_texts)
    print(f"corpus: {len(train_files)} train files ({train_ids.numel()} tokens), "
          f"{len(held_out_files)} held out ({eval_ids.numel()} tokens), vocab {len(tokenizer)}", flush=True)

    config = build_config(recipe, tokenizer)
    model = LlamaForCausalLM(config)
    eval_before = mean_loss(model, eval_ids, recipe.seq_len, max_windows=32)
    started = time.perf_counter()
    curve = train(model, train_ids, recipe)
    train_seconds = time.perf_counter() - started
    eval_after = mean_loss(model, eval_ids, recipe.seq_len, max_windows=32)
    samples = {p: sample_continuation(model, tokenizer, p) for p in ("def ", "import ", "class ")}

    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    name_tokenizer_class_portably(out_dir / "tokenizer_config.json")
    info = {
        "recipe": asdict(recipe),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "train_files": [p.name for p in train_files],
        "held_out_files": [p.name for p in held_out_files],
        "held_out_rule": f"zlib.crc32(file_name) % {HELD_OUT_MODULUS} == 0",
        "train_tokens": train_ids.numel(),
        "held_out_tokens": eval_ids.numel(),
        "held_out_loss_before": round(eval_before, 4),
        "held_out_loss_after": round(eval_after, 4),
        "train_seconds": round(train_seconds, 1),
        "loss_curve": curve,
        "greedy_samples": samples,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    (out_dir / "training_info.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = DemoRecipe()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (e.g. raypaged/demo_model)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=defaults.threads,
                        help="torch CPU threads (fixed: results depend on it)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recipe = DemoRecipe(steps=args.steps, seed=args.seed, threads=args.threads)
    info = build(args.out, recipe)
    first, last = info["loss_curve"][0], info["loss_curve"][-1]
    print(f"train loss {first['train_loss']} -> {last['train_loss']} in {info['train_seconds']} s; "
          f"held-out loss {info['held_out_loss_before']} -> {info['held_out_loss_after']}")
    for prompt, text in info["greedy_samples"].items():
        print(f"--- {prompt!r}\n{prompt}{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
