"""ModelRunner: applies each SchedulerOutput to the persistent batch, runs the model, samples.

One step: drop finished requests → add new ones → apply the cached requests' diffs → the host
tier's offloads and loads (worker/kv_offload.py) → copy-on-write block copies → build input ids,
positions, slot mapping, block tables and sequence lengths (worker/step_inputs.py) → forward
(each attention layer writes K/V by slot mapping, then reads the pool through the block tables)
→ logits of the requests that reached their last token → sample.

Asynchronous scheduling (async_output): each call answers the *previous* step, so the host work of
step N+1 (this diff, inputs, launches) overlaps the GPU running step N. A call launches its step's
forward, then waits for the previous step's sampled tokens (an event, not a device sync: the new
forward stays queued), writes them into the requests' token histories, samples its own step and
starts copying those tokens to the host. An input the scheduler sent as a placeholder is taken
from the previous step's sampled tokens on the device. A step marked grammar_deferred (its
constrained requests' masks wait on the previous step's tokens) keeps its logits instead of
sampling; the next call brings the masks and samples it first, before anything of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.kernels import ops
from raypaged.model.parallel import get_tp_size, tp_broadcast
from raypaged.structured.bitmask import apply_grammar_bitmask
from raypaged.worker.async_output import InFlightTokens, add_sampled_tokens
from raypaged.worker.block_table import BlockTable
from raypaged.worker.cuda_graph import DecodeGraphs
from raypaged.worker.kv_layout import unique_caches
from raypaged.worker.kv_offload import HostKVCache
from raypaged.worker.piecewise_graph import PiecewiseGraphs, piecewise_sizes
from raypaged.worker.prompt_logprobs import score_prompts
from raypaged.worker.request_state import CachedRequestState
from raypaged.worker.sampler import Sampler, SamplingMetadata
from raypaged.worker.sampling_metadata import needs_token_history
from raypaged.worker.step_inputs import StepInputs, build_step_inputs

if TYPE_CHECKING:
    from raypaged.model.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, max_model_len: int, vocab_size: int, device: torch.device,
                 is_driver: bool = True, seed: int | None = None, async_output: bool = False,
                 layer_groups: tuple[int, ...] = ()) -> None:
        """layer_groups: layer i's KV-cache group (worker/kv_layout.py); () or all zeros: one
        group, one table per request."""
        self.model = model
        self.kv_caches = kv_caches
        self.num_groups = max(layer_groups, default=0) + 1
        self.layer_groups = layer_groups if self.num_groups > 1 else ()
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.is_driver = is_driver  # rank 0 samples; the other ranks only run the forward
        self.requests: dict[str, CachedRequestState] = {}
        self.block_table = BlockTable(max_blocks_per_req=-(-max_model_len // block_size),
                                      num_groups=self.num_groups)
        self.sampler = Sampler(seed)
        self.decode_graphs: DecodeGraphs | None = None
        self.piecewise_graphs: PiecewiseGraphs | None = None
        self.async_output = async_output
        self.in_flight = InFlightTokens(device)  # async_output: the step not answered yet
        self._scoring: set[str] = set()  # requests held that asked for prompt logprobs
        # A grammar_deferred step's inputs and logits, sampled when the next call brings its masks.
        self._deferred: tuple[StepInputs, torch.Tensor | None] | None = None
        # The host tier's pool on this rank (worker/kv_offload.py), when the engine has one.
        self.host_kv: HostKVCache | None = None

    def capture_cuda_graphs(self, max_num_seqs: int, piecewise_max_tokens: int | None) -> None:
        """Full graphs for decode-only steps and, unless piecewise_max_tokens is None, piecewise
        graphs for the other steps of up to that many tokens; all in one memory pool."""
        pool = None
        if piecewise_max_tokens is not None:
            # Captured first: its largest bucket needs the most memory, the rest fits within.
            # A decode graph's output may then sit where piecewise temporaries were: harmless,
            # as it is read within its own step, before any other graph replays.
            self.piecewise_graphs = PiecewiseGraphs(self.model, self.kv_caches,
                                                    piecewise_sizes(piecewise_max_tokens),
                                                    self.device)
            pool = self.piecewise_graphs.capture()
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs,
                                          self.block_table.max_blocks_per_req, self.device,
                                          self.layer_groups)
        self.decode_graphs.capture(pool)

    def release(self) -> None:
        """Drop the graphs and the KV pool now. The pool's list is shared with both graph
        runners: emptying it frees the tensors even while something still holds the runner."""
        self.decode_graphs = None
        self.piecewise_graphs = None
        self.kv_caches.clear()
        self.requests.clear()
        self._scoring.clear()
        self.in_flight.clear()
        self._deferred = None
        if self.host_kv is not None:
            self.host_kv.release()
        self.host_kv = None

    # ---- applying the diff -------------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.block_table.free_row(state.row)
            self._scoring.discard(req_id)
        for new in out.scheduled_new_reqs:
            if new.sampling_params.prompt_logprobs is not None:
                self._scoring.add(new.req_id)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                row=self.block_table.add_row(new.group_block_ids or [new.block_ids]),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=new.eos_token_id,
            )
        cached = out.scheduled_cached_reqs
        several_groups = self.num_groups > 1
        for req_id, token_ids, block_ids, num_computed in zip(
            cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[req_id]
            tokens = state.token_ids
            # Positional write: the diff carries the tokens at [num_computed, +len).
            end = num_computed + len(token_ids)
            if end > len(tokens):
                tokens.extend([0] * (end - len(tokens)))
            tokens[num_computed:end] = token_ids
            state.num_computed_tokens = num_computed
            if block_ids:
                self.block_table.append(state.row, out.group_new_block_ids[req_id]
                                        if several_groups else [block_ids])
        if self.host_kv is not None:
            self.host_kv.wait_for_prefetches()
        if out.kv_transfers is not None:  # the host tier's copies come first (core/outputs.py)
            if self.host_kv is None:
                raise RuntimeError("the engine sent host-tier transfers to a worker without a host pool")
            self.host_kv.apply(out.kv_transfers, self.kv_caches)
        if out.block_copies:
            # A block holds one group's layers: copied in every K/V pair once (layers of
            # different groups share pairs).
            pool = unique_caches(self.kv_caches)
            ops.copy_blocks(
                [k for k, _ in pool], [v for _, v in pool],
                torch.tensor(out.block_copies, dtype=torch.int64, device=self.device),
            )

    # ---- building the step's inputs ------------------------------------------------------------
    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """The step's inputs (worker/step_inputs.py), over the requests after this step's diff."""
        return build_step_inputs(out, self.requests, self.block_table, self.block_size,
                                 self.layer_groups, self.in_flight, self.device)

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the step; rank 0 returns its sampled tokens (async_output: the previous step's,
        an empty output for the first step)."""
        if self._deferred is not None:
            self._sample_deferred(out)
        self._update_states(out)
        if out.total_num_scheduled_tokens == 0:
            if self.async_output:
                return self._take_previous()
            return ModelRunnerOutput() if self.is_driver else None
        step = self._prepare_inputs(out)
        # Decode-only: one full graph. Other steps within the bucket cap: graphs between eager
        # attention calls. Larger steps (GPU-bound prefills): eager.
        if self.decode_graphs is not None and self.decode_graphs.can_run(step.metadata):
            hidden = self.decode_graphs.run(step.input_ids, step.positions, step.metadata)
        else:
            # The decode graphs plan their own; here one work list serves every layer.
            step.metadata.plan_decode(self.kv_caches[0][0].shape[2])
            if (self.piecewise_graphs is not None
                    and self.piecewise_graphs.can_run(step.input_ids.shape[0])):
                hidden = self.piecewise_graphs.run(step.input_ids, step.positions, step.metadata)
            else:
                hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.metadata)
        if self._scoring and any(s.req_id in self._scoring for s in step.states):
            step.prompt_logprobs = score_prompts(self.model, hidden, step.states, step.counts,
                                                 self.is_driver)
        row_states = step.row_states
        logits = None
        if row_states:
            logits = self.model.compute_logits(hidden if step.sample_rows is None
                                               else hidden[step.sample_rows])
            if out.grammar_bitmask is not None and self.is_driver:
                self._apply_grammar(out.grammar_bitmask, out.grammar_req_ids, row_states, logits)
        if not self.async_output:
            return self._sample(step, logits, sync=True)
        previous = self._take_previous()  # the histories need its tokens before this step samples
        if out.grammar_deferred:
            self._deferred = (step, logits)
        else:
            self._sample(step, logits, sync=False)
        return previous

    def _sample_deferred(self, out: SchedulerOutput) -> None:
        """Sample the grammar_deferred step kept by the last call, with the masks `out` brings."""
        assert self._deferred is not None
        step, logits = self._deferred
        self._deferred = None
        if out.deferred_bitmask is None:
            raise RuntimeError("the step after a grammar_deferred one must bring its masks")
        if logits is not None and self.is_driver:
            self._apply_grammar(out.deferred_bitmask, out.deferred_req_ids, step.row_states, logits)
        self._sample(step, logits, sync=False)

    def _sample(self, step: StepInputs, logits: torch.Tensor | None,
                sync: bool) -> ModelRunnerOutput | None:
        """Sample the step's rows (rank 0). sync: wait for the tokens and return the answer;
        else start their copy to the host and keep the step in self.in_flight."""
        row_states, sample_indices = step.row_states, step.sample_indices
        if not self.is_driver and sync:
            return None
        states = step.states
        result = ModelRunnerOutput(
            req_ids=[s.req_id for s in states],
            sampled_token_ids=[[] for _ in states],
            logprobs=[None for _ in states],
            prompt_logprobs=step.prompt_logprobs or {},
        ) if self.is_driver else None
        if logits is None:  # prefill chunks only: nothing to sample
            if not sync:
                self.in_flight.keep([], torch.empty(0, dtype=torch.int64), result, None)
            return result
        if not self.is_driver:  # async: its placeholders need the tokens rank 0 samples
            token_ids = torch.empty(len(row_states), dtype=torch.int64, device=self.device)
            self.in_flight.keep(row_states, tp_broadcast(token_ids), None, None)
            return None
        # Token histories only for rows with penalties: copying every request's whole context
        # each step would make the step's host work grow with context length.
        history = [needs_token_history(s.sampling_params) for s in row_states]
        sampling_metadata = SamplingMetadata.build(
            params=[s.sampling_params for s in row_states],
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] if h else () for s, h in zip(row_states, history)],
            output_token_ids=[s.token_ids[s.num_prompt_tokens :] if h else () for s, h in zip(row_states, history)],
            vocab_size=self.vocab_size,
            device=logits.device,
            sample_indices=sample_indices,
            num_output_tokens=[len(s.token_ids) - s.num_prompt_tokens for s in row_states],
        )
        for row, state in enumerate(row_states):
            if state.sampling_params.min_tokens:
                banned = state.min_tokens_stop_ids()
                if banned:
                    logits[row, banned] = float("-inf")
        sampled = self.sampler(logits, sampling_metadata)
        # Logprobs come to the host now (a sync on this step: rows that ask for them give up the
        # overlap of asynchronous scheduling for the step).
        row_logprobs = sampled.logprobs_as_dicts() if sampled.logprobs is not None else None
        if not sync:
            if get_tp_size() > 1:
                tp_broadcast(sampled.sampled_token_ids)
            self.in_flight.keep(row_states, sampled.sampled_token_ids, result, row_logprobs)
            return None
        # The driver's (other ranks returned above), so there is a result.
        add_sampled_tokens(cast(ModelRunnerOutput, result), row_states, sampled.sampled_token_ids.tolist(),
                           row_logprobs)
        return result

    @staticmethod
    def _apply_grammar(bitmask: object, req_ids: list[str], row_states: list[CachedRequestState],
                       logits: torch.Tensor) -> None:
        """Mask the sampled rows of the step's constrained requests, bitmask row i being
        req_ids[i]'s (every sample row of an n > 1 prompt gets its request's mask)."""
        mask_row = {req_id: i for i, req_id in enumerate(req_ids)}
        logit_rows, mask_rows = [], []
        for row, state in enumerate(row_states):
            k = mask_row.get(state.req_id)
            if k is not None:
                logit_rows.append(row)
                mask_rows.append(k)
        apply_grammar_bitmask(logits, cast(np.ndarray, bitmask), logit_rows, mask_rows)

    def _take_previous(self) -> ModelRunnerOutput | None:
        """The previous step's answer (an empty one after a step that ran nothing)."""
        answer = self.in_flight.take(self.requests)
        if answer is None and self.is_driver:
            return ModelRunnerOutput()
        return answer
