"""A minimal paged runner for model tests: what the ModelRunner does, without the scheduler.

It keeps each request's tokens and block list, hands out blocks from a randomly permuted pool
several times larger than needed (so block tables are scattered and non-monotonic), poisons the
pool with NaN (a read of an unwritten slot shows up in the logits), and builds the step's
AttentionMetadata with decodes first, as the ModelRunner does. It returns logits for every token
computed, so a test can compare all positions against transformers.
"""

from __future__ import annotations

import torch

from raypaged.model.attention import AttentionMetadata
from raypaged.model.config import ModelConfig


class PagedHarness:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        *,
        block_size: int,
        num_blocks: int = 64,
        tp: int = 1,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        kv_heads = config.num_kv_heads_per_rank(tp)
        shape = (num_blocks, block_size, kv_heads, config.head_dim)
        self.kv_caches = [
            (
                torch.full(shape, float("nan"), dtype=dtype, device=device),
                torch.full(shape, float("nan"), dtype=dtype, device=device),
            )
            for _ in range(config.num_hidden_layers)
        ]
        generator = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        # (request, position) -> logits row, for every token computed so far
        self.logits: dict[str, dict[int, torch.Tensor]] = {}

    def add_tokens(self, req_id: str, token_ids: list[int]) -> None:
        self.tokens.setdefault(req_id, []).extend(token_ids)
        self.num_computed.setdefault(req_id, 0)
        self.blocks.setdefault(req_id, [])
        self.logits.setdefault(req_id, {})

    def step(self, schedule: dict[str, int]) -> dict[str, torch.Tensor]:
        """Compute `schedule[req]` more tokens of each request; returns each request's logits
        for its last computed token."""
        order = sorted(schedule, key=lambda r: schedule[r] != 1)  # decodes first
        counts = [schedule[r] for r in order]
        num_decodes = next((i for i, n in enumerate(counts) if n != 1), len(counts))
        ids, positions, slots, seq_lens = [], [], [], []
        for req, n in zip(order, counts):
            start = self.num_computed[req]
            assert start + n <= len(self.tokens[req]), f"{req}: scheduling unknown tokens"
            while len(self.blocks[req]) * self.block_size < start + n:
                self.blocks[req].append(self.free_blocks.pop())
            for pos in range(start, start + n):
                ids.append(self.tokens[req][pos])
                positions.append(pos)
                block = self.blocks[req][pos // self.block_size]
                slots.append(block * self.block_size + pos % self.block_size)
            seq_lens.append(start + n)
        max_blocks = max(len(self.blocks[r]) for r in order)
        tables = torch.zeros(len(order), max_blocks, dtype=torch.int32)
        for row, req in enumerate(order):
            tables[row, : len(self.blocks[req])] = torch.tensor(self.blocks[req])
        query_start_loc = torch.zeros(len(order) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(torch.tensor(counts), 0)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=query_start_loc.to(dev),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            max_query_len=max(counts),
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev),
                self.kv_caches,
                meta,
            )
            logits = self.model.compute_logits(hidden).float().cpu()
        last: dict[str, torch.Tensor] = {}
        cursor = 0
        for req, n in zip(order, counts):
            start = self.num_computed[req]
            for i in range(n):
                self.logits[req][start + i] = logits[cursor + i]
            last[req] = logits[cursor + n - 1]
            self.num_computed[req] = start + n
            cursor += n
        return last

    def logits_of(self, req_id: str) -> torch.Tensor:
        """[num_computed, vocab] logits of every position of `req_id`, in order."""
        rows = self.logits[req_id]
        return torch.stack([rows[p] for p in range(len(rows))])


def run_mixed_schedule(
    harness: PagedHarness, prompts: dict[str, list[int]], decode_steps: int, chunk: str | None = None
) -> dict[str, list[int]]:
    """Prefill every prompt in one batched step — except `chunk`, whose prompt is split in two,
    the second half computed in the next step beside the others' first decodes — then decode
    greedily. Returns each request's generated tokens."""
    generated: dict[str, list[int]] = {r: [] for r in prompts}
    for req, prompt in prompts.items():
        harness.add_tokens(req, prompt)
    first = {r: len(p) for r, p in prompts.items()}
    if chunk is not None:
        first[chunk] = len(prompts[chunk]) // 2
    last = harness.step(first)
    pending = {r: len(prompts[r]) - first[r] for r in prompts}

    def feed(logits_by_req: dict[str, torch.Tensor]) -> None:
        for req, logits in logits_by_req.items():
            if harness.num_computed[req] == len(harness.tokens[req]):
                token = int(logits.argmax())
                generated[req].append(token)
                harness.add_tokens(req, [token])

    feed({r: v for r, v in last.items() if pending[r] == 0})
    for _ in range(decode_steps):
        schedule = {r: (pending[r] or 1) for r in prompts}
        pending = {r: 0 for r in prompts}
        feed(harness.step(schedule))
    return generated
