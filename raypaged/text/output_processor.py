"""One request's engine outputs → the CompletionDelta messages its client streams.

Per sample: incremental detokenization, stop strings on the text, logprobs, the finish reason.
A stop string ends a sample here, before the engine knows: the caller aborts it there, and the
engine's late records for that sample are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raypaged.core.errors import RequestFailedError
from raypaged.core.group_progress import GroupProgress
from raypaged.core.outputs import EngineCoreOutput, Logprobs
from raypaged.core.request import FinishReason, Request
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.text.detokenizer import IncrementalDetokenizer
from raypaged.text.stop_strings import StopStringMatcher

FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


@dataclass
class _Sample:
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher | None
    num_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" once over (for metrics)
    stopped_by_string: bool = False  # over here, but the engine may still be generating it


@dataclass
class ProcessedOutput:
    delta: pb.CompletionDelta
    num_new_tokens: int
    finish_reason: str | None  # set when this delta ends its sample


class RequestOutputProcessor:
    def __init__(self, request: Request, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        params = request.sampling_params
        self.request = request
        self._num_logprobs = params.logprobs
        self.samples = [
            _Sample(IncrementalDetokenizer(tokenizer, request.prompt_token_ids, skip_special_tokens),
                    StopStringMatcher(params.stop) if params.stop else None)
            for _ in range(params.n)
        ]
        self.num_cached_tokens = 0
        self.progress = GroupProgress(params.n)  # the client's view: a stop string ends a sample here

    @property
    def finished(self) -> bool:
        """Every sample the client was promised has had its finishing delta."""
        return self.progress.complete

    def unfinished_sample_indices(self) -> list[int]:
        return self.progress.open_indices

    def samples_stopped_by_strings(self) -> list[int]:
        return [i for i, s in enumerate(self.samples) if s.stopped_by_string]

    def usage(self) -> pb.Usage:
        return pb.Usage(prompt_tokens=self.request.num_prompt_tokens,
                        completion_tokens=sum(s.num_tokens for s in self.samples),
                        cached_tokens=self.num_cached_tokens)

    def process(self, out: EngineCoreOutput) -> ProcessedOutput | None:
        """The delta for one engine output; None for a sample that is already over."""
        sample = self.samples[out.sample_index]
        if not self.progress.is_open(out.sample_index):
            return None
        if out.error is not None:
            raise RequestFailedError(f"request {self.request.group_id!r} failed in the engine: {out.error}")
        if out.num_cached_tokens is not None:  # sent on a request's first and last records only
            self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        new_ids = out.new_token_ids
        sample.num_tokens += len(new_ids)
        delta = pb.CompletionDelta(index=out.sample_index, token_ids=new_ids)
        if out.new_logprobs is not None:
            delta.logprobs.extend(self._logprobs(new_ids, out.new_logprobs))
        if out.prompt_logprobs is not None:
            delta.prompt_logprobs.extend(self._prompt_logprobs(out.prompt_logprobs))

        text = sample.detokenizer.push(new_ids) if new_ids else ""
        if out.finished:
            text += sample.detokenizer.flush()
        if sample.stop is not None:
            text, stop = sample.stop.feed(text)
            if stop is not None:
                delta.text = text
                delta.finish_reason = pb.FINISH_REASON_STOP
                delta.stop_string = stop
                sample.stopped_by_string = not out.finished
                return self._finish(sample, delta, FinishReason.STOP, len(new_ids))
            if out.finished:
                text += sample.stop.flush()
        delta.text = text
        if out.finish_reason is None:  # not finished
            return ProcessedOutput(delta, len(new_ids), None)
        delta.finish_reason = FINISH_REASONS[out.finish_reason]
        if isinstance(out.stop_reason, int):
            delta.stop_token_id = out.stop_reason
        return self._finish(sample, delta, out.finish_reason, len(new_ids))

    def _finish(self, sample: _Sample, delta: pb.CompletionDelta, reason: FinishReason,
                num_new_tokens: int) -> ProcessedOutput:
        sample.finish_reason = reason.value
        self.progress.end(delta.index)
        return ProcessedOutput(delta, num_new_tokens, reason.value)

    def _prompt_logprobs(self, logprobs: list[Logprobs]) -> list[pb.TokenLogprobs]:
        """One per prompt token; the first, which nothing scores, with a NaN logprob."""
        prompt = self.request.prompt_token_ids
        first = pb.TokenLogprobs(token_id=prompt[0], logprob=float("nan"))
        k = self.request.sampling_params.prompt_logprobs or 0
        return [first] + self._logprobs(prompt[1:], logprobs, k)

    def _logprobs(self, token_ids: list[int], logprobs: list[Logprobs],
                  k: int | None = None) -> list[pb.TokenLogprobs]:
        """Each position's dict holds the sampled token and the top-k; top_logprobs are the k
        likeliest (the sampled token only where it is among them). k: the request's logprobs
        unless given."""
        k = (self._num_logprobs or 0) if k is None else k
        result = []
        for token_id, position in zip(token_ids, logprobs):
            top = sorted(position.items(), key=lambda item: -item[1])[:k]
            result.append(pb.TokenLogprobs(
                token_id=token_id, logprob=position.get(token_id, float("nan")),
                top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top]))
        return result
