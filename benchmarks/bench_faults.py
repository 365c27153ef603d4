"""Worker faults on real GPUs: a TP=2 engine (NCCL) on the built-in demo model, greedy requests in
flight, and one rank SIGKILLed, raising, or hung mid-generation. For each fault: how long until
the engine noticed, how long until tokens flowed again, and whether every request's tokens equal
the fault-free run's (no gap, no repeat, no change). CPU runs of the same faults (gloo) are
tests/reliability/test_faults.py; NCCL differs in that a surviving rank blocks in its collective
for good when its peer is gone.

    python -m benchmarks.bench_faults                # CPU: gloo -> faults_cpu.json
    bash scripts/gpu.sh faults                        # two GPUs (NCCL), .device/ carried -> faults_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import ray

from raypaged import LLM, SamplingParams
from raypaged.core.request import Request

NUM_REQUESTS = 8
MAX_TOKENS = 64
FAULT_AFTER_STEPS = 6


def prompts(vocab_size: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(8, 200))] for _ in range(NUM_REQUESTS)]


def kill_rank(llm: LLM) -> None:
    os.kill(llm.engine.executor.worker_pids()[1], signal.SIGKILL)


def raise_in_rank(llm: LLM) -> None:
    def arm(actor) -> None:
        def failing(*args, **kwargs):
            raise RuntimeError("injected fault: the worker's step raised")
        actor.worker.execute_model = failing

    ray.get(llm.engine.executor.workers[1].__ray_call__.remote(arm))


def hang_in_rank(llm: LLM) -> None:
    def arm(actor) -> None:
        def hanging(*args, **kwargs):
            time.sleep(3600)
        actor.worker.execute_model = hanging

    ray.get(llm.engine.executor.workers[1].__ray_call__.remote(arm))


FAULTS = {"none": None, "sigkill": kill_rank, "raise": raise_in_rank, "hang": hang_in_rank}


def run(llm: LLM, fault: str, prompt_ids: list[list[int]]) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tag = f"{fault}-"
    for i, prompt in enumerate(prompt_ids):
        engine.add_request(Request(f"{tag}{i}", prompt, params))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompt_ids))}
    restarts_before = engine.num_worker_restarts
    injected_at = noticed_at = resumed_at = None
    steps = 0
    started = time.monotonic()
    while engine.has_unfinished_requests():
        if steps == FAULT_AFTER_STEPS and FAULTS[fault] is not None:
            FAULTS[fault](llm)
            injected_at = time.monotonic()
        outputs = engine.step()
        steps += 1
        if injected_at is not None and noticed_at is None and engine.num_worker_restarts > restarts_before:
            noticed_at = time.monotonic()
        for out in outputs:
            assert out.error is None, out.error
            tokens[int(out.req_id[len(tag):])].extend(out.new_token_ids)
            if noticed_at is not None and resumed_at is None and out.new_token_ids:
                resumed_at = time.monotonic()
    free = engine.scheduler.kv_cache_manager.num_free_blocks
    return {
        "tokens": tokens, "seconds": round(time.monotonic() - started, 2),
        "worker_restarts": engine.num_worker_restarts - restarts_before,
        # The step that failed returns after the group is back: noticed = restarted here.
        "restarted_after_s": None if noticed_at is None else round(noticed_at - injected_at, 2),
        "tokens_again_after_s": None if resumed_at is None else round(resumed_at - injected_at, 2),
        "pool_whole": free == engine.num_blocks,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--faults", default="sigkill,raise,hang")
    parser.add_argument("--step-timeout", type=float, default=20.0)
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    llm = LLM(None, tensor_parallel_size=2, step_timeout_s=args.step_timeout, max_worker_restarts=2)
    vocab = llm.engine.model_config.vocab_size
    prompt_ids = prompts(vocab)
    results = {}
    try:
        reference = run(llm, "none", prompt_ids)
        print(f"fault-free: {reference['seconds']} s")
        for fault in args.faults.split(","):
            result = run(llm, fault, prompt_ids)
            same = result["tokens"] == reference["tokens"]
            counts_ok = all(len(t) == MAX_TOKENS for t in result["tokens"].values())
            print(f"{fault:8s} restarts {result['worker_restarts']}  restarted after "
                  f"{result['restarted_after_s']} s  tokens again after {result['tokens_again_after_s']} s  "
                  f"equal to fault-free: {same}  {MAX_TOKENS} tokens each: {counts_ok}  "
                  f"pool whole: {result['pool_whole']}")
            results[fault] = {k: v for k, v in result.items() if k != "tokens"} | {
                "equal_to_fault_free": same, "all_tokens": counts_ok}
    finally:
        llm.shutdown()
        ray.shutdown()
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (gloo)"
    record = {"device": device, "tp": 2, "torch": torch.__version__,
              "commit": os.environ.get("RAYPAGED_COMMIT"), "num_requests": NUM_REQUESTS,
              "max_tokens": MAX_TOKENS, "step_timeout_s": args.step_timeout,
              "fault_after_steps": FAULT_AFTER_STEPS, "fault_free_seconds": reference["seconds"],
              "faults": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "faults_h200x2.json" if torch.cuda.is_available() else "faults_cpu.json"
    (out / name).write_text(json.dumps(record, indent=2) + "\n")
    ok = all(r["equal_to_fault_free"] and r["all_tokens"] and r["pool_whole"] and r["worker_restarts"] == 1
             for r in results.values())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
