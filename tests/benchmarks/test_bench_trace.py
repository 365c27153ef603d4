"""The decode trace's per-layer profile (benchmarks/lib/trace.py, bench_decode --mode trace), on
synthetic traces."""

from __future__ import annotations

from benchmarks.lib.trace import layer_profile


def trace(steps: int, layers: int, overlap: float = 0.0) -> list[tuple[float, float, str]]:
    """Decode steps of an 8B-like layer order. Each kernel starts `overlap` µs before its
    predecessor ends (PDL), the LM head at the step's end takes 240 µs."""
    events, now = [], 0.0

    def kernel(name: str, duration: float) -> None:
        nonlocal now
        start = max(0.0, now - overlap)
        events.append((start, start + duration + overlap, name))
        now = start + duration + overlap

    for _ in range(steps):
        kernel("embed", 1)
        kernel("rms_norm", 1)
        kernel("gemv", 14)  # qkv
        for layer in range(layers):
            kernel("decode_split", 7)
            kernel("gemv", 10)  # o
            kernel("rms_norm", 2)
            kernel("gemv", 56)  # gate/up
            kernel("gemv", 30)  # down
            if layer < layers - 1:
                kernel("rms_norm", 2)
                kernel("gemv", 14)  # the next layer's qkv
        kernel("rms_norm", 2)
        kernel("gemv", 240)  # LM head
        kernel("argmax", 2)
    return sorted(events)


def test_whole_layers_only_so_the_lm_head_is_no_qkv():
    profile = layer_profile(trace(steps=3, layers=5))
    assert [round(profile[f"gemv#{i}"][1]) for i in range(4)] == [10, 56, 30, 14]
    assert "argmax#0" not in profile and "embed#0" not in profile


def test_what_a_kernel_adds_is_not_its_overlapped_duration():
    profile = layer_profile(trace(steps=2, layers=4, overlap=3.0))
    duration, adds = profile["gemv#1"]
    assert round(duration) == 59 and round(adds) == 56  # started 3 µs before the o GEMM ended
    assert layer_profile(trace(steps=1, layers=1)) == {}  # no whole layer in the trace
