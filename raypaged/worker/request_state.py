"""A request as a worker holds it between steps: its tokens, its sampling and its block-table row."""

from __future__ import annotations

from dataclasses import dataclass

from raypaged.core.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs the worker has been told of, by position
    num_prompt_tokens: int
    sampling_params: SamplingParams
    row: int  # its row in the BlockTable
    num_computed_tokens: int
    eos_token_id: int | None = None

    def min_tokens_stop_ids(self) -> list[int]:
        """Token ids it may not sample yet: EOS and stop ids until min_tokens are out (as vLLM
        and transformers' MinNewTokensLengthLogitsProcessor do)."""
        params = self.sampling_params
        if len(self.token_ids) - self.num_prompt_tokens >= params.min_tokens:
            return []
        eos = [] if self.eos_token_id is None or params.ignore_eos else [self.eos_token_id]
        return list(params.stop_token_ids) + eos

