"""KV per request for a model whose layers differ: every layer a full-length table (as the
plain manager allocates) against KV-cache groups (the hybrid manager), at several contexts.

One request of each context runs through the real Scheduler (chunked prefill, then decode) with
the FakeModelRunner. Two figures per allocator: the most KV its blocks held at once (a sliding
group peaks during a prefill chunk: window + chunk) and what they hold while it decodes its last
token. Today's pool (make_kv_cache_manager's one full group) gives every layer the table, so its
bytes are blocks x block_size x num_layers x layer_token_bytes; a grouped block holds block_size
tokens of group_size layers (groups are cut to equal size, the short one padded: see
kv_cache_groups), so grouped bytes are blocks x block_bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from raypaged.core.kv_cache_groups import (
    FULL_ATTENTION,
    KVCacheGroupSpec,
    group_layers,
    group_size,
    make_kv_cache_manager,
)
from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from raypaged.simulator.fake_runner import FakeModelRunner

CONTEXTS = (8192, 32768, 131072)
DECODE_TOKENS = 16  # the request's last tokens are decoded one a step


@dataclass(frozen=True)
class LayeredModel:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    sliding_window: int
    full_every: int  # every full_every-th layer is global (full attention), the rest slide

    def layer_windows(self) -> list[int | None]:
        return [None if (i + 1) % self.full_every == 0 else self.sliding_window
                for i in range(self.num_layers)]

    @property
    def layer_token_bytes(self) -> int:
        """One token's K and V in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes


# Gemma 3 27B's attention shape: 62 layers, 5 local (window 1024) : 1 global, 16 KV heads of 128.
GEMMA3_27B = LayeredModel("gemma3-27b", num_layers=62, num_kv_heads=16, head_dim=128, dtype_bytes=2,
                          sliding_window=1024, full_every=6)
MODELS = {"gemma3": GEMMA3_27B}


@dataclass
class Held:
    peak_blocks: int = 0
    peak_group_blocks: tuple[int, ...] = ()
    decode_blocks: int = 0  # while it computes its last token
    decode_group_blocks: tuple[int, ...] = ()
    pool_whole_at_end: bool = False


def run_one(groups: tuple[KVCacheGroupSpec, ...], context: int, block_size: int,
            max_num_batched_tokens: int) -> Held:
    """One request of `context` tokens through the Scheduler with these groups' manager."""
    num_blocks = len(groups) * -(-context // block_size)  # room for every group's full table
    manager = make_kv_cache_manager(num_blocks, block_size, groups, enable_prefix_caching=False,
                                    max_tokens_per_step=max_num_batched_tokens)
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=1,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=context,
        enable_prefix_caching=False, enable_chunked_prefill=True), kv_cache_manager=manager)
    prompt = [1 + i % 1000 for i in range(context - DECODE_TOKENS)]
    scheduler.add_request(Request("r", prompt, SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True),
                                  eos_token_id=0))
    runner, held = FakeModelRunner(), Held()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()  # measured as the step's forward sees the pool
        stats = manager.stats()
        if stats.num_used_blocks > held.peak_blocks:
            held.peak_blocks, held.peak_group_blocks = stats.num_used_blocks, stats.group_blocks
        held.decode_blocks, held.decode_group_blocks = stats.num_used_blocks, stats.group_blocks
        scheduler.update_from_output(out, runner.execute(out))
    held.pool_whole_at_end = manager.num_free_blocks == num_blocks
    return held


def kv_per_request(model: LayeredModel, block_size: int = 16,
                   max_num_batched_tokens: int = 2048, contexts: tuple[int, ...] = CONTEXTS) -> dict:
    """The report: for each context, today's full allocation vs groups, in bytes."""
    windows = model.layer_windows()
    grouped = group_layers(windows)
    block_bytes = group_size(grouped) * block_size * model.layer_token_bytes
    full_block_bytes = model.num_layers * block_size * model.layer_token_bytes  # every layer
    rows = []
    for context in contexts:
        full = run_one(FULL_ATTENTION, context, block_size, max_num_batched_tokens)
        ours = run_one(grouped, context, block_size, max_num_batched_tokens)
        rows.append({
            "context": context,
            "full_peak_bytes": full.peak_blocks * full_block_bytes,
            "grouped_peak_bytes": ours.peak_blocks * block_bytes,
            "full_decode_bytes": full.decode_blocks * full_block_bytes,
            "grouped_decode_bytes": ours.decode_blocks * block_bytes,
            "grouped_peak_blocks_per_group": list(ours.peak_group_blocks),
            "grouped_decode_blocks_per_group": list(ours.decode_group_blocks),
            # Every layer's own window of tokens, no padding, no block tails: the lower bound.
            "ideal_grouped_bytes": model.layer_token_bytes * sum(
                context if w is None else min(context, w) for w in windows),
            "peak_ratio": full.peak_blocks * full_block_bytes / (ours.peak_blocks * block_bytes),
            "decode_ratio": full.decode_blocks * full_block_bytes / (ours.decode_blocks * block_bytes),
            "pool_whole_at_end": full.pool_whole_at_end and ours.pool_whole_at_end,
        })
    return {"model": asdict(model), "block_size": block_size,
            "max_num_batched_tokens": max_num_batched_tokens, "group_size": group_size(grouped),
            "groups": [{"sliding_window": g.sliding_window, "layers": list(g.layer_ids)} for g in grouped],
            "block_bytes": block_bytes, "rows": rows}


def format_report(report: dict) -> str:
    gib = 1 << 30
    lines = [f"{report['model']['name']}: KV per request (peak, one request), "
             f"{len(report['groups'])} groups of {report['group_size']} layers, "
             f"block {report['block_size']} tokens = {report['block_bytes'] / (1 << 20):.2f} MiB",
             f"{'context':>8}  {'full':>9}  {'grouped peak':>12}  {'ratio':>6}  "
             f"{'grouped decode':>14}  {'ratio':>6}  {'ideal':>9}"]
    for row in report["rows"]:
        lines.append(f"{row['context']:>8}  {row['full_peak_bytes'] / gib:>6.2f}GiB  "
                     f"{row['grouped_peak_bytes'] / gib:>9.2f}GiB  {row['peak_ratio']:>5.2f}x  "
                     f"{row['grouped_decode_bytes'] / gib:>11.2f}GiB  {row['decode_ratio']:>5.2f}x  "
                     f"{row['ideal_grouped_bytes'] / gib:>6.2f}GiB")
    return "\n".join(lines)
