"""One step's model inputs, built from the SchedulerOutput and the requests the worker holds.

build_step_inputs orders the step's requests (single-token ones first: the decode kernel takes
them, paged prefill the rest) and builds input ids, positions, slot mapping, block tables (one
per KV-cache group), sequence lengths and the rows to sample, each copied to the device once.
Under asynchronous scheduling an input the scheduler sent as a placeholder is taken from the
previous step's sampled tokens on the device (worker/async_output.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raypaged.core.outputs import Logprobs, SchedulerOutput
from raypaged.core.request import PLACEHOLDER_TOKEN_ID
from raypaged.model.attention import AttentionMetadata
from raypaged.worker.async_output import InFlightTokens
from raypaged.worker.block_table import BlockTable
from raypaged.worker.request_state import CachedRequestState


@dataclass
class StepInputs:
    """One step's inputs on the device, and which rows it samples for which request."""

    states: list[CachedRequestState]  # in step order: decodes first
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_rows: torch.Tensor | None  # rows of the hidden states to sample; None: every row
    row_states: list[CachedRequestState]  # per sampled row
    sample_indices: list[int]  # per sampled row: which of the request's n samples
    # Asynchronous scheduling: (index in input_ids, request id) of each placeholder input.
    placeholders: list[tuple[int, str]]
    counts: list[int]  # tokens of each of `states` in the step
    # Set after the forward: the prompt positions this step scored (worker/prompt_logprobs.py).
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] | None = None



def build_step_inputs(out: SchedulerOutput, requests: dict[str, CachedRequestState],
                      block_table: BlockTable, block_size: int, layer_groups: tuple[int, ...],
                      in_flight: InFlightTokens, device: torch.device) -> StepInputs:
    """The inputs of the step `out` schedules over `requests` (by id, their diffs applied).
    layer_groups: () for one KV-cache group, else layer i's group (the metadata carries a table
    and slot mapping per group)."""
    # Single-token requests first: the decode kernel takes them, paged prefill the rest.
    scheduled = sorted(out.num_scheduled_tokens.items(), key=lambda item: item[1] != 1)
    states = [requests[req_id] for req_id, _ in scheduled]
    counts = [n for _, n in scheduled]
    num_decodes = next((i for i, n in enumerate(counts) if n != 1), len(counts))

    input_ids: list[int] = []
    starts: list[int] = []
    # Requests whose step reaches their last known token produce a sample; a prefill chunk
    # that stops short of it does not.
    sample_rows: list[int] = []  # index into the step's tokens of each sampled row's last token
    row_states: list[CachedRequestState] = []
    sample_indices: list[int] = []
    placeholders: list[tuple[int, str]] = []
    cursor = 0
    for state, n in zip(states, counts):
        start = state.num_computed_tokens
        tokens = state.token_ids
        if n == 1:
            token = tokens[start]
            if token == PLACEHOLDER_TOKEN_ID:
                placeholders.append((cursor, state.req_id))
            input_ids.append(token)
        else:
            input_ids.extend(tokens[start : start + n])
        starts.append(start)
        cursor += n
        if start + n < len(tokens):
            continue
        # n > 1 samples are drawn from the prompt's logits once, then the request forks.
        fan_out = state.sampling_params.n if len(tokens) == state.num_prompt_tokens else 1
        for index in range(fan_out):
            sample_rows.append(cursor - 1)
            row_states.append(state)
            sample_indices.append(index)
    num_tokens = len(input_ids)
    query_lens = np.array(counts, dtype=np.int64)
    query_start_loc = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_lens = np.array(starts, dtype=np.int64) + query_lens
    # Each token's position: its request's start plus its index within this step's chunk.
    # Tables and slots per KV-cache group: [groups, S, width] and [groups, T].
    block_tables = block_table.gather(np.array([s.row for s in states]))
    if num_decodes == len(counts):
        positions = seq_lens - 1
        req_of_token = np.arange(num_tokens)
    else:
        positions = (np.arange(num_tokens)
                     + np.repeat(np.array(starts) - query_start_loc[:-1], query_lens))
        req_of_token = np.repeat(np.arange(len(counts)), query_lens)
    # Contiguous per group (fancy indexing may leave the group axis innermost): the kernels
    # step along a row by one element.
    block_tables = np.ascontiguousarray(block_tables)
    slot_mapping = np.ascontiguousarray(
        block_tables[:, req_of_token, positions // block_size].astype(np.int64)
        * block_size + positions % block_size)
    # Every row sampled once, in order (a plain decode step): no gather of the hidden states.
    # Not just as many samples as rows: a 2-token last chunk of an n = 2 prompt beside decodes
    # also has one sample a row, both from its last row.
    all_rows = sample_rows == list(range(num_tokens))
    # One small copy per array. Packing them into one pinned buffer was measured slower on
    # the H200 (benchmarks/bench_staging.py: 149 vs 81 us a step at batch 1).
    dev = device
    ids_t = to_device(np.array(input_ids, dtype=np.int64), dev)
    if placeholders:
        in_flight.fill_placeholders(ids_t, placeholders)
    rows_t = None if all_rows else to_device(np.array(sample_rows, dtype=np.int64), dev)
    group_tables = group_slots = None
    if layer_groups:
        group_tables, group_slots = to_device(block_tables, dev), to_device(slot_mapping, dev)
    metadata = AttentionMetadata(
        slot_mapping=group_slots[0] if group_slots is not None else to_device(slot_mapping[0], dev),
        block_tables=group_tables[0] if group_tables is not None else to_device(block_tables[0], dev),
        seq_lens=to_device(seq_lens.astype(np.int32), dev),
        query_start_loc=to_device(query_start_loc.astype(np.int32), dev),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=max(counts),
        group_block_tables=group_tables,
        group_slot_mappings=group_slots,
        layer_groups=layer_groups,
    )
    return StepInputs(states, ids_t, to_device(positions, dev), metadata, rows_t,
                      row_states, sample_indices, placeholders, counts)



def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """The array on the device, copied without waiting for the stream (host work overlaps)."""
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
