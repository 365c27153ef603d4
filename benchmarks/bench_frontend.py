"""What the gRPC frontend costs (CPU; the tiny test checkpoint).

1. Per token, in process: RequestOutputProcessor (incremental detokenizer, stop strings,
   logprobs) + building and serializing the GenerateResponse, on synthetic engine outputs.
2. End to end, one engine: the same concurrent greedy requests through the async engine client
   directly and through the gRPC server (tokens checked identical first): wall time, output
   tokens/s, TTFT and inter-token latency medians as the client sees them.

    python -m benchmarks.bench_frontend [--streams 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time

from benchmarks.lib.common import environment, write_json


def processor_cost(tokenizer, vocab: int, num_tokens: int = 20000) -> dict:
    from raypaged.core.outputs import EngineCoreOutput
    from raypaged.core.request import FinishReason, Request
    from raypaged.core.sampling_params import SamplingParams
    from raypaged.proto.v1 import raypaged_pb2 as pb
    from raypaged.text.output_processor import RequestOutputProcessor

    rng = random.Random(0)
    ids = [rng.randrange(3, vocab) for _ in range(num_tokens)]
    results = {}
    cases = {"plain": SamplingParams(max_tokens=num_tokens),
             "stop_strings_4": SamplingParams(max_tokens=num_tokens,
                                              stop=("<|end|>", "###END", "\n\n\n\n", "STOPSTOP")),
             "logprobs_5": SamplingParams(max_tokens=num_tokens, logprobs=5)}
    for name, params in cases.items():
        request = Request("r", [5, 6, 7], params)
        processor = RequestOutputProcessor(request, tokenizer)
        outputs = []
        for i, t in enumerate(ids):
            logprobs = None
            if params.logprobs:
                logprobs = [{t: -0.5, **{rng.randrange(vocab): -1.0 - k for k in range(5)}}]
            finish = FinishReason.LENGTH if i == num_tokens - 1 else None
            outputs.append(EngineCoreOutput("r", "r", 0, [t], logprobs, finish, None, 3, 0))
        count = 0
        start = time.perf_counter()
        for out in outputs:
            processed = processor.process(out)
            if processed is None:  # a stop string matched: the rest would be dropped unprocessed
                break
            pb.GenerateResponse(request_id="r", outputs=[processed.delta]).SerializeToString()
            count += 1
        elapsed = time.perf_counter() - start
        assert count > num_tokens // 2, f"{name}: a stop string ended the run after {count} tokens"
        results[name] = round(elapsed / count * 1e6, 2)
    return results


async def end_to_end(model_dir: str, streams: int, max_tokens: int) -> dict:
    from transformers import AutoTokenizer

    from raypaged.client import AsyncClient
    from raypaged.config import EngineConfig
    from raypaged.core.request import Request
    from raypaged.core.sampling_params import SamplingParams
    from raypaged.engine.client import AsyncEngineClient
    from raypaged.frontend.server import FrontendServer, ServerConfig

    engine = await AsyncEngineClient.start(EngineConfig(
        model=model_dir, device="cpu", max_num_seqs=streams, num_gpu_blocks_override=streams * 8))
    server = FrontendServer(engine, AutoTokenizer.from_pretrained(model_dir), ServerConfig(port=0),
                            owns_engine=True)
    await server.start()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(8, 32))] for _ in range(streams)]
    try:
        async def direct(i, prompt, timings):
            start, times, tokens = time.perf_counter(), [], []
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for out in engine.generate(Request(f"d{i}-{time.monotonic_ns()}", prompt, params)):
                times.append(time.perf_counter())
                tokens += out.new_token_ids
            timings.append((start, times))
            return tokens

        async def over_grpc(client, prompt, timings):
            start, times, tokens = time.perf_counter(), [], []
            async for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0,
                                             ignore_eos=True):
                times.append(time.perf_counter())
                tokens += chunk.outputs[0].token_ids
            timings.append((start, times))
            return tokens

        async def run(kind):
            timings: list = []
            start = time.perf_counter()
            if kind == "direct":
                tokens = await asyncio.gather(*[direct(i, p, timings) for i, p in enumerate(prompts)])
            else:
                async with AsyncClient(server.address) as client:
                    tokens = await asyncio.gather(*[over_grpc(client, p, timings) for p in prompts])
            wall = time.perf_counter() - start
            ttft = [times[0] - s for s, times in timings]
            itl = [b - a for _, times in timings for a, b in itertools.pairwise(times)]
            return tokens, {"wall_s": round(wall, 3),
                            "output_tokens_per_s": round(streams * max_tokens / wall, 1),
                            "ttft_p50_ms": round(statistics.median(ttft) * 1e3, 2),
                            "itl_p50_ms": round(statistics.median(itl) * 1e3, 2)}

        await run("direct")  # warm-up
        direct_tokens, direct_stats = await run("direct")
        grpc_tokens, grpc_stats = await run("grpc")
        assert grpc_tokens == direct_tokens, "gRPC outputs differ from the engine's"
        return {"direct_engine_client": direct_stats, "grpc": grpc_stats}
    finally:
        await server.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import ray
    from transformers import AutoTokenizer

    from tests.support.checkpoints import checkpoint_dir  # the tiny test checkpoint

    model_dir = str(checkpoint_dir("llama"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    per_token = processor_cost(tokenizer, len(tokenizer))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        e2e = asyncio.run(end_to_end(model_dir, args.streams, args.max_tokens))
    finally:
        ray.shutdown()
    result = {"environment": environment(), "model": "tests/checkpoints llama (2 layers, hidden 64), CPU",
              "streams": args.streams, "max_tokens": args.max_tokens,
              "processor_us_per_token": per_token, "end_to_end": e2e}
    path = write_json("frontend_cpu", result, args.out)
    print(f"{'per token (µs)':>28}: " + ", ".join(f"{k} {v}" for k, v in per_token.items()))
    print(f"{'':>28}  {'wall s':>7} {'tok/s':>8} {'TTFT p50 ms':>12} {'ITL p50 ms':>11}")
    for kind, stats in e2e.items():
        print(f"{kind:>28}  {stats['wall_s']:>7} {stats['output_tokens_per_s']:>8} "
              f"{stats['ttft_p50_ms']:>12} {stats['itl_p50_ms']:>11}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
