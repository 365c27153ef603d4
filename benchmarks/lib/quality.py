"""What the quality benchmark measures, as pure pieces: the held-out text, its perplexity through
raypaged's prompt logprobs, and greedy agreement between two runs (bench_quality.py drives them).

Held-out text: the demo model (raypaged/demo_model/) was trained on the top-level modules of
Python's standard library except those `training_info.json` lists as held out (a rule on the file
name); those files, read from the running interpreter's stdlib and tokenized as training did
(``<s> file </s>`` documents in one stream), are text the model never saw.

Perplexity: exp of the mean next-token NLL over consecutive, non-overlapping windows of the
stream (the first token of each window is context only), as the demo's training recipe measured
its held-out loss. Each window is one request with `prompt_logprobs`, so the logprobs come from
raypaged's own forward (prefill, the KV pool in the run's dtype, the run's GEMMs).
"""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from raypaged import LLM, SamplingParams


def held_out_files(model_dir: Path) -> list[Path]:
    """The held-out stdlib files `training_info.json` names, in this interpreter's stdlib.
    Raises FileNotFoundError if the model has no such record or a file is missing."""
    info_path = model_dir / "training_info.json"
    if not info_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no training_info.json: no record of its held-out text")
    names = json.loads(info_path.read_text())["held_out_files"]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = [stdlib / name for name in names]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"held-out files missing from {stdlib}: {', '.join(missing)}")
    return paths


def token_stream(tokenizer, texts: Sequence[str]) -> list[int]:
    """One stream of ``<s> text </s>`` documents (scripts/make_demo_model.py's tokenize_corpus)."""
    ids: list[int] = []
    for doc in tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]:
        ids.append(tokenizer.bos_token_id)
        ids.extend(doc)
        ids.append(tokenizer.eos_token_id)
    return ids


def read_texts(paths: Sequence[Path]) -> list[str]:
    # As training read them: a few stdlib files are Latin-1.
    return [p.read_text(encoding="utf-8", errors="replace") for p in paths]


def text_digest(texts: Sequence[str]) -> str:
    """sha256 of the texts: two runs on different Pythons show whether they scored the same text."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8", errors="replace"))
    return digest.hexdigest()[:16]


def windows(stream: Sequence[int], length: int, count: int | None = None) -> list[list[int]]:
    """Consecutive, non-overlapping windows of `length` tokens from the start (at most `count`)."""
    total = len(stream) // length
    if total == 0:
        raise ValueError(f"a stream of {len(stream)} tokens holds no window of {length}")
    count = total if count is None else min(count, total)
    return [list(stream[i * length : (i + 1) * length]) for i in range(count)]


@dataclass
class Scores:
    """Per window, per scored token (tokens 1.. of the window): its logprob and the top-1 token."""

    logprobs: list[list[float]]
    top1: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(len(w) for w in self.logprobs)

    def perplexity(self) -> float:
        return math.exp(-sum(map(sum, self.logprobs)) / self.num_tokens)


def score(llm: LLM, chunks: Sequence[Sequence[int]]) -> Scores:
    """Every window's prompt logprobs through the engine (one request a window, all at once)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    results = llm.generate([{"prompt_token_ids": list(c)} for c in chunks], params)
    logprobs, top1 = [], []
    for chunk, result in zip(chunks, results):
        entries = result.prompt_logprobs
        if entries is None or len(entries) != len(chunk):
            raise RuntimeError(f"request {result.request_id}: expected {len(chunk)} prompt logprob entries")
        logprobs.append([entry[token] for token, entry in zip(chunk[1:], entries[1:])])
        top1.append([max(entry, key=entry.__getitem__) for entry in entries[1:]])
    return Scores(logprobs, top1)


def greedy(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation of exactly max_tokens tokens (EOS ignored)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
    return [list(r.outputs[0].token_ids) for r in results]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where a and b differ; their common length if neither does."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def greedy_agreement(base: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict:
    """How far `other`'s greedy outputs follow `base`'s: per prompt, the first divergence; over
    all tokens, the share before each prompt's first divergence (the strict measure: after it the
    two runs continue different texts) and the share of positions holding the same token."""
    if len(base) != len(other) or any(len(a) != len(b) for a, b in zip(base, other)):
        raise ValueError("greedy outputs of different shapes")
    total = sum(len(a) for a in base)
    divergence = [first_divergence(a, b) for a, b in zip(base, other)]
    same = sum(x == y for a, b in zip(base, other) for x, y in zip(a, b))
    return {"tokens": total,
            "identical_prompts": sum(d == len(a) for d, a in zip(divergence, base)),
            "prefix_agreement": sum(divergence) / total,
            "positional_agreement": same / total,
            "first_divergence": divergence}


def scores_against(base: Scores, other: Scores) -> dict:
    """Perplexity change and teacher-forced agreement of `other` against `base` on the same text:
    the share of positions where both predict the same top-1 token, and the mean absolute
    difference of the text's token logprobs."""
    pairs = [(a, b) for wa, wb in zip(base.logprobs, other.logprobs) for a, b in zip(wa, wb)]
    tops = [(a, b) for wa, wb in zip(base.top1, other.top1) for a, b in zip(wa, wb)]
    if len(pairs) != base.num_tokens or len(pairs) != other.num_tokens:
        raise ValueError("scores of different texts")
    ppl_base, ppl = base.perplexity(), other.perplexity()
    return {"perplexity_change": ppl / ppl_base - 1.0,
            "top1_agreement": sum(a == b for a, b in tops) / len(tops),
            "mean_abs_logprob_delta": sum(abs(a - b) for a, b in pairs) / len(pairs)}
