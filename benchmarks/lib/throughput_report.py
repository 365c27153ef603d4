"""What the offline throughput benchmark (benchmarks/bench_throughput.py) concludes from its
record: the ratios it adds (paged / contiguous, each precision over the baseline, paged /
transformers, raypaged / a published peer, issue 22's FP8 target) and the table printed last."""

from __future__ import annotations

from collections.abc import Sequence

# Issue 22: FP8 weights + FP8 KV at >= 1.5x bf16's output tok/s on the ShareGPT-like run.
FP8_TARGET = 1.5


def add_ratios(result: dict, modes: Sequence[str]) -> None:
    """Every ratio of the record, from its measured (or, for published peers, recorded) tok/s;
    over_baseline in the order of modes."""
    precisions = result["precisions"]
    for runs in precisions.values():
        if "paged" in runs and "contiguous" in runs:
            runs["paged_vs_contiguous"] = (runs["paged"]["output_tokens_per_s"]
                                           / runs["contiguous"]["output_tokens_per_s"])
    base = precisions.get(result["baseline_precision"] or "")
    for name, runs in precisions.items():
        if base is not None and name != result["baseline_precision"]:
            runs["over_baseline"] = {mode: runs[mode]["output_tokens_per_s"] / base[mode]["output_tokens_per_s"]
                                     for mode in modes if mode in runs and mode in base}
    hf = result.get("hf_generate")
    if hf is not None and "paged" in precisions.get(hf["precision"], {}):
        runs = precisions[hf["precision"]]
        runs["paged_vs_hf"] = runs["paged"]["output_tokens_per_s"] / hf["output_tokens_per_s"]
        runs["paged_vs_hf_uncut"] = (runs["paged"]["output_tokens_per_s"]
                                     / hf["projected_uncut_output_tokens_per_s"])
    for peer in result.get("published_peers", []):
        ours = precisions.get(peer["precision"], {}).get("paged")
        peer["raypaged_paged_output_tokens_per_s"] = ours["output_tokens_per_s"] if ours else None
        peer["raypaged_over_published"] = ours["output_tokens_per_s"] / peer["output_tokens_per_s"] if ours else None
        peer["same_gpu_as_this_run"] = peer["gpu"] in result["env"]["device"]
    fp8 = precisions.get("fp8", {}).get("over_baseline", {}).get("paged")
    if result["workload"]["name"] == "sharegpt" and result["baseline_precision"] == "bf16" and fp8 is not None:
        result["target"] = {"what": f"fp8 / bf16 paged output tok/s >= {FP8_TARGET} (issue 22)",
                            "value": fp8, "met": fp8 >= FP8_TARGET}


def print_table(result: dict) -> None:
    print("\n| what | figure |\n| --- | --- |")
    for precision, runs in result["precisions"].items():
        for mode in result["modes"]:
            if mode not in runs:
                continue
            r, mem = runs[mode], runs[mode]["memory"]["all_steps"]
            print(f"| raypaged {precision} {mode} | {r['output_tokens_per_s']:,.0f} output tok/s "
                  f"({r['seconds']:.1f} s, "
                  f"mean running {mem.get('mean_running', 0):.1f}, peak {r['memory']['peak_running']}, "
                  f"{r['preemptions']} preemptions, {r['num_kv_blocks']} blocks) |")
            if mem:
                print(f"| KV memory, {precision} {mode} | filled / held {mem['kv_utilization']:.1%}; pool holding "
                      f"tokens {mem['pool_token_states']:.1%}, held but empty {mem['waste_share_of_pool']:.1%}; "
                      f"{mem['unfilled_slots_per_running_request']:.1f} empty slots per running request |")
        if "paged_vs_contiguous" in runs:
            print(f"| {precision}: paged / contiguous reservation | {runs['paged_vs_contiguous']:.2f}x "
                  "(target >= 2x) |")
        for mode, ratio in runs.get("over_baseline", {}).items():
            print(f"| {precision} / {result['baseline_precision']}, {mode} | {ratio:.2f}x |")
    if "target" in result:
        target = result["target"]
        print(f"| {target['what']} | {target['value']:.2f}x: {'met' if target['met'] else 'not met'} |")
    if "hf_generate" in result:
        hf = result["hf_generate"]
        cut = ", cut by --hf-max-time" if hf["truncated"] else ""
        print(f"| transformers static batches, {hf['dtype']} ({hf['requests']} requests, batch "
              f"{hf['batch_size']}{cut}) | {hf['output_tokens_per_s']:,.0f} output tok/s "
              f"(uncut at the same step rate: {hf['projected_uncut_output_tokens_per_s']:,.0f}) |")
        runs = result["precisions"].get(hf["precision"], {})
        if "paged_vs_hf" in runs:
            print(f"| paged / transformers | {runs['paged_vs_hf']:.1f}x (target >= 20x; "
                  f"{runs['paged_vs_hf_uncut']:.1f}x against the uncut figure) |")
    for peer in result.get("published_peers", []):
        ours = peer["raypaged_over_published"]
        other = "" if peer["same_gpu_as_this_run"] else f", not this run's {result['env']['device']}"
        print(f"| {peer['engine']} {peer['precision']}, {peer['gpu']}{other}, published (not measured here; "
              f"{peer['num_requests']} requests) | {peer['output_tokens_per_s']:,.0f} output tok/s"
              + (f"; raypaged {peer['precision']} paged here / published {ours:.2f}x" if ours is not None else "")
              + " |")
    print(f"| whole run | {result['wall_seconds']:.0f} s |")
