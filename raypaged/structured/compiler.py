"""Grammar compilation: a StructuredOutput spec -> xgrammar CompiledGrammar, on a thread pool.

One GrammarCompiler per engine, built (with its TokenizerInfo, from the model's HF tokenizer) on
the first compile, in a pool thread: loading the tokenizer never runs on the step loop either.
JSON schemas compile without free whitespace (xgrammar's compact layout, as vLLM's
disable_any_whitespace): a model cannot then spend its max_tokens on blanks. Compiled grammars
are cached by the spec's key (the engine has one tokenizer, so (tokenizer, spec) reduces to
spec); concurrent requests with the same spec share one compile.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from raypaged.core.errors import InvalidRequestError
from raypaged.core.structured_output import StructuredOutput

__all__ = ["GrammarCompilerPool", "check_spec", "choice_ebnf"]


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly the choices (JSON string escapes, which
    xgrammar's EBNF literals read the same way)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _grammar(spec: StructuredOutput) -> xgr.Grammar:
    kind = spec.kind
    if kind == "json":
        return xgr.Grammar.from_json_schema(str(spec.json), any_whitespace=False)
    if kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if kind == "regex":
        return xgr.Grammar.from_regex(str(spec.regex))
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(tuple(spec.choice or ())))
    return xgr.Grammar.from_ebnf(str(spec.grammar))


def check_spec(spec: StructuredOutput) -> None:
    """InvalidRequestError naming the problem if xgrammar rejects the schema, regex or grammar.
    A parse, not a compile: cheap enough for the request's way in."""
    try:
        _grammar(spec)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own types
        raise InvalidRequestError(f"invalid structured output {spec.kind}: {e}") from None


class GrammarCompilerPool:
    """compile(spec) -> a Future of its CompiledGrammar; never blocks the caller."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_workers: int = 2) -> None:
        self._tokenizer_dir = tokenizer_dir
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        # spec key -> its compile: a failed one stays too (the same spec fails the same way).
        self._futures: dict[tuple[str, str], Future[xgr.CompiledGrammar]] = {}
        self.cache_hits = 0  # compile() calls that found the spec compiled or compiling
        self.cache_misses = 0

    def compile(self, spec: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        key = spec.key
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                self.cache_misses += 1
                future = self._futures[key] = self._pool.submit(self._compile, spec)
            else:
                self.cache_hits += 1
        return future

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        kind = spec.kind
        if kind == "json":
            return compiler.compile_json_schema(str(spec.json), any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(str(spec.regex))
        if kind == "choice":
            return compiler.compile_grammar(choice_ebnf(tuple(spec.choice or ())))
        return compiler.compile_grammar(str(spec.grammar))

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_dir)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def shutdown(self) -> None:
        # A compile cannot be interrupted: its thread finishes it and the result is dropped.
        self._pool.shutdown(wait=False, cancel_futures=True)
