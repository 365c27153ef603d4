"""The offline API, in the style of vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from raypaged.config import EngineConfig
from raypaged.core.errors import InvalidRequestError, RaypagedError
from raypaged.core.outputs import EngineCoreOutput
from raypaged.core.request import FinishReason, Request
from raypaged.core.sample_ids import sample_id
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.text_check import invalid_text_message, lone_surrogate
from raypaged.engine.core import EngineCore
from raypaged.outputs import CompletionOutput, RequestOutput
from raypaged.text.detokenizer import IncrementalDetokenizer
from raypaged.text.stop_strings import StopStringMatcher


@dataclass
class _SampleText:
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher


class RequestsFailedError(RaypagedError):
    """The engine failed some requests (e.g. a model worker died); `outputs` holds everything
    generated, the failed samples marked with their error."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


# A prompt is text, or token ids as {"prompt_token_ids": [...]} (vLLM's TokensPrompt).
Prompt = str | dict


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 tensor_parallel_size: int = 1, skip_tokenizer_init: bool = False,
                 **engine_kwargs) -> None:
        """engine_kwargs: any EngineConfig setting by its flat name (max_num_seqs=8, ...).
        skip_tokenizer_init: token ids in and out only (no text), as in vLLM.
        Raises ConfigError for settings that can never work."""

        config = EngineConfig(model=model, tokenizer=tokenizer,
                              tensor_parallel_size=tensor_parallel_size, **engine_kwargs)
        self.engine = EngineCore(config)
        self.tokenizer = None
        if not skip_tokenizer_init:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or self.engine.model_dir)
        self._ids = itertools.count()
        self._text: dict[str, list[_SampleText]] = {}  # per request, per sample

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                       else list(sampling_params))
        if len(params_list) != len(prompts):
            raise InvalidRequestError("need one SamplingParams per prompt, or a single one")

        results: dict[str, RequestOutput] = {}
        # Every prompt is checked before any is queued, and a refused add takes back those
        # queued before it: a bad prompt in a batch leaves nothing running in the engine.
        tokenized = [self._tokenize(prompt) for prompt in prompts]
        for (text, token_ids), params in zip(tokenized, params_list):
            request_id = str(next(self._ids))
            try:
                self.engine.add_request(Request(request_id, token_ids, params))
            except Exception:
                if results:  # their abort records are ignored later, as stop strings' are
                    self.engine.abort_requests(list(results))
                for earlier in results:
                    self._text.pop(earlier, None)
                raise
            results[request_id] = RequestOutput(
                request_id, text, token_ids,
                outputs=[CompletionOutput(i, "", []) for i in range(params.n)])
            if self.tokenizer is not None:
                self._text[request_id] = [
                    _SampleText(IncrementalDetokenizer(self.tokenizer, token_ids),
                                StopStringMatcher(params.stop)) for _ in range(params.n)]

        progress = tqdm(total=len(results), disable=not use_tqdm, desc="generate")
        unfinished = set(results)
        while unfinished:
            for out in self.engine.step():
                result = results.get(out.group_id)
                if result is not None:  # else: the abort record of a sample an earlier call
                    self._apply(result, out)  # ended on a stop string
            for request_id in [r for r in unfinished if results[r].finished]:
                unfinished.discard(request_id)
                progress.update(1)
            if unfinished and not self.engine.has_unfinished_requests():
                # Every sample gets a finishing record (core/group_progress.py): one missing is
                # a bug, and waiting for it would spin here forever.
                raise RaypagedError(f"the engine holds none of requests {sorted(unfinished)} "
                                    "but some of their samples never finished")
        progress.close()
        for request_id in results:
            self._text.pop(request_id, None)
        outputs = list(results.values())
        failed = [o for r in outputs for o in r.outputs if o.error]
        if failed:
            raise RequestsFailedError(f"{len(failed)} of the samples failed: {failed[0].error}", outputs)
        return outputs

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer (skip_tokenizer_init is set)")
            bad = lone_surrogate(prompt)
            if bad is not None:
                raise InvalidRequestError(f"prompt: {invalid_text_message(bad)}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        raise InvalidRequestError("a prompt is a string or {'prompt_token_ids': [...]}")

    def _apply(self, result: RequestOutput, out: EngineCoreOutput) -> None:
        sample = result.outputs[out.sample_index]
        if sample.finished:  # e.g. stopped on a stop string, its abort record arriving late
            return
        if out.num_cached_tokens is not None:  # sent on a request's first and last records only
            result.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:  # every sample's first record: the group's
            result.prompt_logprobs = [None, *out.prompt_logprobs]
        sample.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            sample.logprobs = (sample.logprobs or []) + list(out.new_logprobs)
        if out.finish_reason is not None:  # finished
            sample.finish_reason = out.finish_reason.value
            sample.stop_reason = out.stop_reason
            sample.error = out.error
        texts = self._text.get(result.request_id)
        if texts is None:
            return
        state = texts[out.sample_index]
        delta = state.detokenizer.push(out.new_token_ids)
        if out.finished:
            delta += state.detokenizer.flush()
        released, stop = state.stop_matcher.feed(delta)
        sample.text += released
        if stop is not None:  # the text ends before the stop string; the engine drops the sample
            sample.finish_reason, sample.stop_reason = FinishReason.STOP.value, stop
            self.engine.abort_requests([sample_id(out.group_id, out.sample_index)])  # this one only
        elif out.finished:
            sample.text += state.stop_matcher.flush()

    def shutdown(self) -> None:
        self.engine.shutdown()
