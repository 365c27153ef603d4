"""The offline API, in the style of vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from typing import Sequence, Union

from tqdm import tqdm

from raypaged.config import EngineConfig
from raypaged.core.errors import InvalidRequestError, RaypagedError
from raypaged.core.outputs import EngineCoreOutput
from raypaged.core.request import FinishReason, Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.engine.core import EngineCore
from raypaged.outputs import CompletionOutput, RequestOutput

class RequestsFailedError(RaypagedError):
    """The engine failed some requests (e.g. a model worker died); `outputs` holds everything
    generated, the failed samples marked with their error."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


# A prompt is text, or token ids as {"prompt_token_ids": [...]} (vLLM's TokensPrompt).
Prompt = Union[str, dict]


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 tensor_parallel_size: int = 1, skip_tokenizer_init: bool = False,
                 **engine_kwargs) -> None:
        """skip_tokenizer_init: token ids in and out only (no text), as in vLLM."""

        config = EngineConfig(model=model, tokenizer=tokenizer,
                              tensor_parallel_size=tensor_parallel_size, **engine_kwargs)
        self.engine = EngineCore(config)
        self.tokenizer = None
        if not skip_tokenizer_init:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or self.engine.model_dir)
        self._ids = itertools.count()

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
        params_of: dict[str, SamplingParams] = {}
        for prompt, params in zip(prompts, params_list):
            text, token_ids = self._tokenize(prompt)
            request_id = str(next(self._ids))
            self.engine.add_request(Request(request_id, token_ids, params))
            results[request_id] = RequestOutput(
                request_id, text, token_ids,
                outputs=[CompletionOutput(i, "", []) for i in range(params.n)])
            params_of[request_id] = params

        progress = tqdm(total=len(results), disable=not use_tqdm, desc="generate")
        unfinished = set(results)
        while unfinished:
            for out in self.engine.step():
                self._apply(results[out.group_id], out, params_of[out.group_id])
            for request_id in [r for r in unfinished if results[r].finished]:
                unfinished.discard(request_id)
                progress.update(1)
        progress.close()
        outputs = list(results.values())
        failed = [o for r in outputs for o in r.outputs if o.error]
        if failed:
            raise RequestsFailedError(f"{len(failed)} of the samples failed: {failed[0].error}", outputs)
        return outputs

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer (skip_tokenizer_init is set)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        raise InvalidRequestError("a prompt is a string or {'prompt_token_ids': [...]}")

    def _apply(self, result: RequestOutput, out: EngineCoreOutput, params: SamplingParams) -> None:
        sample = result.outputs[out.sample_index]
        if sample.finished:  # e.g. stopped on a stop string, its abort record arriving late
            return
        result.num_cached_tokens = out.num_cached_tokens
        sample.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            sample.logprobs = (sample.logprobs or []) + list(out.new_logprobs)
        if out.finished:
            sample.finish_reason = out.finish_reason.value
            sample.stop_reason = out.stop_reason
            sample.error = out.error
        # Text only where it is needed: at the end, or every step while stop strings are watched.
        if self.tokenizer is not None and (out.finished or params.stop):
            sample.text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            if params.stop and not sample.finished:
                self._check_stop_strings(sample, out.req_id, params)

    def _check_stop_strings(self, sample: CompletionOutput, req_id: str, params: SamplingParams) -> None:
        hits = [(sample.text.find(s), s) for s in params.stop if s in sample.text]
        if not hits:
            return
        index, stop = min(hits)
        sample.text = sample.text[:index]
        sample.finish_reason = FinishReason.STOP.value
        sample.stop_reason = stop
        self.engine.abort_requests([req_id])

    def shutdown(self) -> None:
        self.engine.shutdown()
