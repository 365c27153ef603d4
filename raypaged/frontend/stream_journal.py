"""What the frontend keeps of one stream in flight so that a new engine can go on with it.

Per sample: every token the stream has handed on, whether it has had a record (its first one
carries the prompt's logprobs and cached-token count), whether it is over (its finishing record
came, or the caller ended it: a stop string, an abort). The text side (detokenizer, stop
strings) needs nothing here: it lives in the frontend with the stream and simply goes on with
the next tokens.

`resumptions()` says what to send the new engine: the request itself while no sample has had a
record (nothing was streamed: it starts again from scratch); otherwise one request per sample
still open, `Request.resumed_output_token_ids` carrying its tokens, so the engine recomputes
prompt + tokens and goes on with the same remaining budget (max_tokens, min_tokens), penalties,
grammar state and seeded positions. A sample of an n > 1 request is resumed with the params it
had after the fork (`SamplingParams.for_sample`: n = 1, its own seed), under the id
`sample_id(group, i)`, an id no client can send (the frontend refuses ids with "#").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from raypaged.core.outputs import EngineCoreOutput
from raypaged.core.request import FinishReason, Request
from raypaged.core.sample_ids import parse_sample_id, sample_id, sample_request_id


@dataclass
class _Sample:
    tokens: list[int] = field(default_factory=list)
    has_record: bool = False
    finished: bool = False  # its finishing record was handed on
    closed: bool = False  # the caller ended it

    @property
    def open(self) -> bool:
        return not (self.finished or self.closed)


class StreamJournal:
    def __init__(self, request: Request) -> None:
        self.request = request
        self.samples = [_Sample() for _ in range(request.sampling_params.n)]
        # Whether the engine now runs the open samples as requests of their own (resumed).
        self.per_sample = False

    @property
    def group_id(self) -> str:
        return self.request.group_id

    @property
    def complete(self) -> bool:
        return not any(s.open for s in self.samples)

    @property
    def open_indices(self) -> list[int]:
        return [i for i, s in enumerate(self.samples) if s.open]

    def note(self, out: EngineCoreOutput) -> None:
        """A record the stream hands on (out.sample_index in the group's numbering)."""
        sample = self.samples[out.sample_index]
        sample.has_record = True
        sample.tokens.extend(out.new_token_ids)
        if out.finished:
            sample.finished = True

    def close(self, sample_index: int | None = None) -> None:
        """The caller ended one sample (or, None, all): it is not resumed."""
        for i in range(len(self.samples)) if sample_index is None else (sample_index,):
            self.samples[i].closed = True

    def close_for_abort(self, request_id: str) -> list[str]:
        """The caller aborts `request_id`: the group's id (every sample) or one sample's
        (sample_id(group, i)). Closes what it names and returns the engine request ids to abort:
        a resumed stream runs its samples as requests named sample_id(group, i)."""
        if request_id == self.group_id:
            targets = ([sample_id(request_id, i) for i in self.open_indices] if self.per_sample
                       else [request_id])
            self.close()
            return targets
        _, index = parse_sample_id(request_id)
        assert index is not None, f"{request_id!r} names no sample of {self.group_id!r}"
        self.close(index)
        return [request_id]  # the sample of the group, or the resumed request of that name

    def ends_owed(self) -> list[EngineCoreOutput]:
        """After the engine was lost: the finishing (abort) record of each sample the caller
        ended whose engine died before sending it, as a live engine would have (every sample
        gets one, core/group_progress.py). Each is owed once; note() them like any record."""
        request = self.request
        return [EngineCoreOutput(sample_request_id(request.group_id, i), request.group_id, i, [],
                                 finish_reason=FinishReason.ABORT,
                                 num_prompt_tokens=request.num_prompt_tokens)
                for i, s in enumerate(self.samples) if s.closed and not s.finished]

    def resumptions(self) -> list[tuple[int | None, Request]]:
        """What the next engine runs: [(None, the request)] while nothing has been streamed,
        else (sample index, its resumed request) per open sample. Sets per_sample."""
        if not any(s.has_record for s in self.samples):
            self.per_sample = False
            return [(None, self.request)]
        self.per_sample = True
        return [(i, self._resumed(i)) for i in self.open_indices]

    def _resumed(self, index: int) -> Request:
        original = self.request
        params = original.sampling_params
        if params.n > 1:
            params = params.for_sample(index)
        sample = self.samples[index]
        if sample.has_record and params.prompt_logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=None)  # sent with its first record
        request_id = sample_id(original.group_id, index)
        return Request(request_id, original.prompt_token_ids, params, eos_token_id=original.eos_token_id,
                       arrival_time=original.arrival_time, priority=original.priority,
                       cache_salt=original.cache_salt, group_id=request_id,
                       resumed_output_token_ids=tuple(sample.tokens))


def journal_for(journals: dict[str, StreamJournal], request_id: str) -> StreamJournal | None:
    """The journal (by group id) of the stream an abort names: the group's id or one sample's."""
    journal = journals.get(request_id)
    owner, index = parse_sample_id(request_id)
    if journal is None and index is not None:
        journal = journals.get(owner)
    return journal
