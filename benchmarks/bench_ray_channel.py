"""What one step's dispatch through Ray costs, apart from the work: a worker actor that answers at
once, driven the way RayExecutor drives it (a Compiled Graph, the step's SchedulerOutput in, a
ModelRunnerOutput back), beside a plain actor call.

    python -m benchmarks.bench_ray_channel                 # CPU
    python -m benchmarks.bench_ray_channel --gpu           # the worker holds a GPU, as on the H200

Payloads are a decode step's: `batch` running requests, one token each. Writes
benchmarks/results/ray_channel_<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import ray

from benchmarks.lib.common import environment, write_json
from raypaged.core.outputs import CachedRequestData, ModelRunnerOutput, SchedulerOutput


def decode_step(batch: int, context: int = 1024) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    ids = [f"req-{i}" for i in range(batch)]
    cached = CachedRequestData(req_ids=ids, new_token_ids=[[1000 + i] for i in range(batch)],
                               new_block_ids=[[] for _ in ids], num_computed_tokens=[context] * batch)
    out = SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens=dict.fromkeys(ids, 1),
                          total_num_scheduled_tokens=batch)
    answer = ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids],
                               logprobs=[None for _ in ids])
    return out, answer


class EchoWorker:
    def __init__(self, answer: ModelRunnerOutput) -> None:
        self.answer = answer

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.answer


def round_trips_us(call, iterations: int) -> dict:
    for _ in range(min(50, iterations)):
        call()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"p50_us": statistics.median(times) * 1e6, "p90_us": times[int(0.9 * len(times))] * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--gpu", action="store_true", help="the worker actor holds one GPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not ray.is_initialized():
        ray.init(num_cpus=2, num_gpus=1 if args.gpu else 0, include_dashboard=False, log_to_driver=False)
    from ray.dag import InputNode, MultiOutputNode

    result = {"env": environment(), "args": vars(args), "rows": []}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        step, answer = decode_step(batch)
        worker = ray.remote(EchoWorker).options(num_cpus=0.5, num_gpus=1 if args.gpu else 0).remote(answer)
        row = {"batch": batch,
               "plain_actor_call": round_trips_us(
                   lambda worker=worker, step=step: ray.get(worker.execute_model.remote(step)),
                   max(100, args.iterations // 10))}
        with InputNode() as inp:
            dag = MultiOutputNode([worker.execute_model.bind(inp)])
        compiled = dag.experimental_compile()
        try:
            row["compiled_graph"] = round_trips_us(lambda compiled=compiled, step=step: ray.get(compiled.execute(step)),
                                                      args.iterations)
            row["compiled_graph_get_timeout"] = round_trips_us(
                lambda compiled=compiled, step=step: ray.get(compiled.execute(step), timeout=60.0), args.iterations)
            row["compiled_graph_empty_payload"] = round_trips_us(
                lambda compiled=compiled: ray.get(compiled.execute(None)), args.iterations)
        finally:
            compiled.teardown()
        ray.kill(worker)
        result["rows"].append(row)
        print(f"batch {batch}: " + ", ".join(f"{k} {v['p50_us']:.0f} us" for k, v in row.items()
                                              if isinstance(v, dict)), flush=True)
    device = "gpu" if args.gpu else "cpu"
    print(f"wrote {write_json(f'ray_channel_{device}', result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
