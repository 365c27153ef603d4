"""Operating the Serve app, live (tests/serve/conftest.py's instance): both engine replicas
take work, every replica's metrics reach Prometheus, a TP replica's placement, the demo model
from deploy/serve_demo.yaml, API keys."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest
import ray
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from raypaged.core.sampling_params import SamplingParams
from raypaged.llm import LLM
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.serve import build_app
from tests.serve.serve_harness import (
    ENGINE_ARGS,
    MAX_TOKENS,
    PROMPTS,
    SWITCH,
    engine_replicas,
    engines_idle,
    ingress_stats,
    named_call,
)
from tests.support.checkpoints import demo_model_missing
from tests.support.ray_state import live_placement_groups
from tests.support.serve_grpc import grpc_stub

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_two_engine_replicas_both_serve(server):
    """Requests with no prefix in common are balanced by load: a burst spreads over both."""
    def post(i: int) -> requests.Response:
        body = {"model": "llama", "prompt": PROMPTS[i % 3], "max_tokens": 6}
        return requests.post(f"{server['base']}/v1/completions", json=body, timeout=60)

    before = {r: s["num_streams"] for r, s in engines_idle().items()}
    for _ in range(5):
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(post, range(8)))
        assert all(r.status_code == 200 for r in responses)
        gained = {r: s["num_streams"] - before[r] for r, s in engines_idle().items()}
        if all(gained.values()):
            break
    assert all(gained.values()), gained


def test_every_replicas_metrics_reach_prometheus(server):
    """Ray's node metrics port (what Prometheus scrapes) carries the ingress's request series and
    both engine replicas' KV pool series."""
    url = f"http://127.0.0.1:{server['metrics']}/metrics"
    ingress = ingress_stats()["replica"]
    engines = set(engine_replicas())
    deadline = time.monotonic() + 30
    tokens: set[str] = set()
    pools: set[str] = set()
    while time.monotonic() < deadline:
        text = requests.get(url, timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.name == "ray_raypaged_generation_tokens":
                tokens |= {s.labels["replica"] for s in family.samples if s.value > 0}
            if family.name == "ray_raypaged_kv_cache_blocks":
                pools |= {s.labels["replica"] for s in family.samples if s.value > 0}
        if ingress in tokens and engines <= pools:
            break
        time.sleep(0.5)
    assert ingress in tokens and engines <= pools, (tokens, pools)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ttft = families["ray_raypaged_time_to_first_token_seconds"]
    assert ttft.type == "histogram" and any(s.labels.get("model_name") == "llama" for s in ttft.samples)


def test_tensor_parallel_replica_places_workers_in_its_bundles(server, oracle):
    """tp = 2: Serve reserves the replica's group (replica + 2 worker bundles); the engine actor and
    both TP workers run inside it, and no second group is made."""
    groups_before = set(live_placement_groups())
    args = {"model": server["model"], "tensor_parallel_size": 2, "num_replicas": 1,
            "ray_cpus_per_worker": 0.1, **ENGINE_ARGS}
    serve.run(build_app(args), name="tp2", route_prefix="/tp2")
    try:
        (group,) = set(live_placement_groups()) - groups_before
        table = ray.util.placement_group_table()[group]
        assert list(table["bundles"].values()) == [{"CPU": 0.1}, {"CPU": 0.1}, {"CPU": 0.1}]
        # Every bundle's CPU is taken: bundle 0 by the replica, bundles 1 and 2 by the workers.
        free = ray.available_resources()
        assert [free.get(f"CPU_group_{i}_{group}", 0.0) for i in range(3)] == [0.0, 0.0, 0.0]
        api = openai.OpenAI(base_url=f"{server['base']}/tp2/v1", api_key="unused", max_retries=0, timeout=60)
        response = api.completions.create(model="llama", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                          temperature=0.0, extra_body={"ignore_eos": True})
        assert response.choices[0].text == oracle["outputs"][0].text
        [call] = named_call(api).choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SWITCH["function"]["parameters"])
    finally:
        serve.delete("tp2")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and set(live_placement_groups()) != groups_before:
        time.sleep(0.2)
    assert set(live_placement_groups()) == groups_before

@pytest.mark.skipif(demo_model_missing(), reason="the built-in demo model (raypaged/demo_model) is not built")
def test_demo_model_from_serve_config(server):
    """deploy/serve_demo.yaml's application, as written, on this module's Serve instance."""
    config = yaml.safe_load((ROOT / "deploy" / "serve_demo.yaml").read_text())
    (app_config,) = config["applications"]
    assert app_config["import_path"] == "raypaged.serve:build_app"
    serve.run(build_app(app_config["args"]), name="demo", route_prefix="/demo")
    try:
        api = openai.OpenAI(base_url=f"{server['base']}/demo/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in api.models.list().data] == ["demo"]
        chunks = list(api.completions.create(model="demo", prompt="def fib(n):", max_tokens=16,
                                             temperature=0.0, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert 1 <= chunks[-1].usage.completion_tokens <= 16
        llm = LLM()  # the demo model, offline
        try:
            expected = llm.generate("def fib(n):", SamplingParams(temperature=0.0, max_tokens=16))
        finally:
            llm.shutdown()
        assert text == expected[0].outputs[0].text
    finally:
        serve.delete("demo")


def test_api_keys_in_the_serve_app(server, tmp_path):
    """An app with api_keys_file: both transports need a known key (401 / UNAUTHENTICATED), the
    key's limits hold (429 with Retry-After; gRPC RESOURCE_EXHAUSTED), and two keys sending the
    same prompt never share prefix-cache hits while one key's repeat does."""
    keys = {"sk-serve-alpha-of-the-test": {"name": "alpha"},
            "sk-serve-beta-of-the-test": {"name": "beta"},
            "sk-serve-paced-of-the-test": {"name": "paced", "requests_per_second": 0.001, "burst": 1}}
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": keys}))
    serve.run(build_app({"model": server["model"], "api_keys_file": str(path), **ENGINE_ARGS}),
              name="keyed", route_prefix="/keyed")
    try:
        def api(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{server['base']}/keyed/v1", api_key=key, max_retries=0, timeout=60)

        prompt = list(range(3, 43))  # 40 tokens: two full blocks of 16

        def cached(key: str) -> int:
            usage = api(key).completions.create(model="llama", prompt=prompt, max_tokens=2, temperature=0.0).usage
            return usage.prompt_tokens_details.cached_tokens

        with pytest.raises(openai.AuthenticationError):
            api("sk-not-a-key-of-the-app").models.list()
        assert requests.get(f"{server['base']}/keyed/health", timeout=30).status_code == 200
        assert [cached("sk-serve-alpha-of-the-test"), cached("sk-serve-alpha-of-the-test"),
                cached("sk-serve-beta-of-the-test")] == [0, 32, 0]
        api("sk-serve-paced-of-the-test").completions.create(model="llama", prompt=[5], max_tokens=1)
        with pytest.raises(openai.RateLimitError) as limited:
            api("sk-serve-paced-of-the-test").completions.create(model="llama", prompt=[5], max_tokens=1)
        assert int(limited.value.response.headers["retry-after"]) > 900
        stub, channel = grpc_stub(server)
        with channel:
            request = pb.GenerateRequest(prompt_token_ids=[5, 6], sampling_params=pb.SamplingParams(max_tokens=2))
            metadata = (("application", "keyed"),)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request, metadata=metadata, timeout=60))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as paced:
                list(stub.Generate(request, timeout=60, metadata=metadata + (
                    ("authorization", "Bearer sk-serve-paced-of-the-test"),)))
            assert paced.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            responses = list(stub.Generate(request, timeout=60, metadata=metadata + (
                ("authorization", "Bearer sk-serve-beta-of-the-test"),)))
            assert sum(len(d.token_ids) for r in responses for d in r.outputs) == 2
    finally:
        serve.delete("keyed")
