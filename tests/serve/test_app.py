"""raypaged on Ray Serve, live: one module-scoped Ray + Serve instance serving a tiny checkpoint
with two replicas (two engines), reached the way users reach it — the official openai client,
raw HTTP, a grpc stub through Serve's gRPC proxy — and the demo model from deploy/serve_demo.yaml.

The oracle is the offline LLM on the same checkpoint: greedy output must match token for token.
"""

from __future__ import annotations

import json
import socket
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
from raypaged.proto.v1 import raypaged_pb2_grpc as pb_grpc
from raypaged.serve import GRPC_SERVICER_FUNCTION, build_app
from raypaged.serve.chat_template import chat_prompt_token_ids
from tests.support.checkpoints import checkpoint_dir, demo_model_missing
from tests.support.ray_state import live_actors, live_placement_groups

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
APP = "raypaged"
PROMPTS = ["The block table maps", "def attention(query, key", "Pack my box with"]
MAX_TOKENS = 12
ENGINE_ARGS = {"num_gpu_blocks_override": 64, "max_num_seqs": 8, "replica_num_cpus": 0.1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    # Ray exports the replicas' metrics on its node metrics port; report often so a test sees them.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=ports["metrics"], _system_config={"metrics_report_interval_ms": 500})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": ports["http"]},
                    grpc_options={"port": ports["grpc"], "grpc_servicer_functions": [GRPC_SERVICER_FUNCTION]})
        model = str(checkpoint_dir("llama"))
        serve.run(build_app({"model": model, "num_replicas": 2, "tool_call_parser": "hermes",
                             "enable_auto_tool_choice": True, **ENGINE_ARGS}), name=APP, route_prefix="/")
        yield {**ports, "model": model, "base": f"http://127.0.0.1:{ports['http']}"}
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def oracle(server):
    """The offline engine's greedy continuations of PROMPTS, and its tokenizer."""
    llm = LLM(server["model"], num_gpu_blocks_override=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params)
        chat_ids = chat_prompt_token_ids(llm.tokenizer, [{"role": "user", "content": PROMPTS[0]}], 10**6)
        chat_output = llm.generate({"prompt_token_ids": chat_ids}, params)[0].outputs[0]
        yield {"outputs": [o.outputs[0] for o in outputs], "chat": chat_output, "tokenizer": llm.tokenizer}
    finally:
        llm.shutdown()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['base']}/v1", api_key="unused", max_retries=0, timeout=60)


def replica_reports(predicate, num_replicas: int = 2, timeout_s: float = 20.0) -> dict[str, dict]:
    """engine_stats of every replica, polled (a handle call reaches a replica Serve picks) until
    each one's latest report satisfies predicate."""
    handle = serve.get_app_handle(APP)
    latest: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = handle.engine_stats.remote().result()
        latest[report["replica"]] = report
        if len(latest) == num_replicas and all(predicate(r) for r in latest.values()):
            return latest
        time.sleep(0.05)
    raise AssertionError(f"replicas never all satisfied the condition: {latest}")


def idle_and_whole(report: dict) -> bool:
    return (report["num_running"] == 0 and report["num_waiting"] == 0 and report["in_flight"] == 0
            and report["num_free_blocks"] == report["num_blocks"])


def test_models_route(server):
    models = client(server).models.list().data
    assert [m.id for m in models] == ["llama"]


def test_completion_stream_equals_offline_greedy(server, oracle):
    api = client(server)
    for prompt, expected in zip(PROMPTS, oracle["outputs"]):
        chunks = list(api.completions.create(model="llama", prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage  # usage rides on the last chunk
        assert usage is not None and usage.completion_tokens == MAX_TOKENS
        assert all(c.usage is None for c in chunks[:-1])
    # Not streamed, as token ids: the same continuation.
    prompt_ids = oracle["tokenizer"].encode(PROMPTS[0])
    response = api.completions.create(model="llama", prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                      temperature=0.0, extra_body={"ignore_eos": True})
    assert response.choices[0].text == oracle["outputs"][0].text
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.total_tokens == len(prompt_ids) + MAX_TOKENS


def test_chat_stream_equals_offline_greedy(server, oracle):
    chunks = list(client(server).chat.completions.create(
        model="llama", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX_TOKENS,
        temperature=0.0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    content = [c.choices[0].delta for c in chunks if c.choices]
    assert content[0].role == "assistant"
    assert "".join(d.content or "" for d in content) == oracle["chat"].text
    # include_usage: OpenAI's own shape, a last chunk with no choices and the usage.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_logprobs_and_n(server):
    response = client(server).completions.create(
        model="llama", prompt=PROMPTS[1], max_tokens=4, temperature=1.0, n=2, seed=7, logprobs=2)
    assert sorted(c.index for c in response.choices) == [0, 1]
    for choice in response.choices:
        assert len(choice.logprobs.tokens) == 4 and len(choice.logprobs.top_logprobs[0]) == 2
        assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)
    assert response.usage.completion_tokens == 8


BAD_REQUESTS = [
    # (route, body, status, param or a piece of the message)
    ("completions", {"model": "llama"}, 400, "prompt"),
    ("completions", {"model": "llama", "prompt": ""}, 400, "empty"),
    ("completions", {"model": "llama", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"model": "llama", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": "llama", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": "llama", "prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("completions", {"model": "llama", "prompt": "x", "max_tokens": 1000}, 400, "context length"),
    ("completions", {"model": "llama", "prompt": [5, 10**6]}, 400, "not a token id"),
    ("completions", {"model": "llama", "prompt": "x", "n": 1000}, 400, "n must be"),
    ("completions", {"model": "llama", "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"model": "llama", "prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("completions", {"model": "llama", "prompt": "x", "logit_bias": {"1000000": 1.0}}, 400, "logit_bias"),
    ("completions", {"model": "llama", "prompt": ["a", "b"]}, 400, "one prompt"),
    ("completions", {"model": "llama", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("chat/completions", {"model": "llama", "messages": []}, 400, "messages"),
    ("chat/completions", {"model": "llama", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("chat/completions", {"model": "llama", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "only text"),
    ("chat/completions", {"model": "llama", "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function", "function": {"description": "no name"}}]}, 400,
     "function.name"),
    ("chat/completions", {"model": "llama", "messages": [{"role": "user", "content": "x"}],
                          "top_logprobs": 2}, 400, "top_logprobs"),
]


def test_bad_requests_get_openai_shaped_errors(server):
    base = f"{server['base']}/v1"
    with requests.Session() as http:
        for route, body, status, needle in BAD_REQUESTS:
            for stream in (False, True):
                response = http.post(f"{base}/{route}", json={**body, "stream": stream}, timeout=30)
                assert response.status_code == status, (body, response.text)
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == ("invalid_request_error" if status in (400, 404) else error["type"])
                assert needle in error["message"] or needle == error["param"], (body, error)
        response = http.post(f"{base}/completions", data=b"{not json",
                             headers={"content-type": "application/json"}, timeout=30)
        assert response.status_code == 400 and "error" in response.json()
        for method, route, status in (("post", "/nowhere", 404), ("get", "/completions", 405)):
            response = getattr(http, method)(f"{base}{route}", timeout=30)
            assert response.status_code == status and set(response.json()["error"]) >= {"message", "type"}
    with pytest.raises(openai.BadRequestError) as raised:
        client(server).completions.create(model="llama", prompt="x", temperature=-1)
    assert raised.value.status_code == 400 and "temperature" in raised.value.body["message"]
    # Nothing reached an engine, and both still serve.
    replica_reports(idle_and_whole)
    assert client(server).completions.create(model="llama", prompt="x", max_tokens=2).usage.completion_tokens >= 1


LONE = "\ud800"  # a lone UTF-16 surrogate: a valid JSON escape ("\\ud800"), no valid text
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
TEXT = {"model": "llama", "prompt": "x", "max_tokens": 2}
# Every text field a client can send (issue 24: each was a 500), and the param each must name.
BAD_TEXT = [
    ("completions", {**TEXT, "prompt": LONE}, "prompt"),
    ("completions", {**TEXT, "prompt": ["ok " + LONE]}, "prompt.0"),
    ("completions", {**TEXT, "stop": LONE}, "stop"),
    ("completions", {**TEXT, "stop": ["a", LONE]}, "stop.1"),
    ("completions", {**TEXT, "request_id": LONE}, "request_id"),
    ("completions", {**TEXT, "cache_salt": LONE}, "cache_salt"),
    ("completions", {**TEXT, "user": LONE}, "user"),
    ("completions", {**TEXT, "model": LONE}, "model"),
    ("completions", {**TEXT, "suffix": "\udfff"}, "suffix"),
    ("completions", {**TEXT, "an_unknown_field": LONE}, "an_unknown_field"),
    ("chat/completions", {**CHAT, "stop": [LONE]}, "stop.0"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": LONE}]}]}, "messages.0.content.1.text"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "name": LONE}]},
     "messages.0.name"),
    ("chat/completions", {**CHAT, "model": LONE}, "model"),
]
# Wrong JSON types are refused, not coerced (OpenAI's API is strict).
WRONG_TYPES = [
    ("completions", {**TEXT, "stream": "yes"}, "stream"),
    ("completions", {**TEXT, "max_tokens": "10"}, "max_tokens"),
    ("completions", {**TEXT, "n": True}, "n"),
    ("completions", {**TEXT, "ignore_eos": 1}, "ignore_eos"),
    ("completions", {**TEXT, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    ("chat/completions", {**CHAT, "logprobs": "true"}, "logprobs"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 2.5}, "max_completion_tokens"),
]


def test_bad_text_and_wrong_types_are_400s_naming_the_field(server):
    """Issue 24: lone surrogates gave HTTP 500 (a plain-text one for "model"); wrong types were
    coerced. Each is a 400 in OpenAI's shape whose param names the field, streamed or not."""
    base = f"{server['base']}/v1"
    with requests.Session() as http:
        for route, body, field in BAD_TEXT + WRONG_TYPES:
            for stream in (False, True):
                sent = body if "stream" in body else {**body, "stream": stream}
                # json.dumps writes the surrogate as the escape a client would send.
                response = http.post(f"{base}/{route}", data=json.dumps(sent),
                                     headers={"content-type": "application/json"}, timeout=30)
                assert response.status_code == 400, (route, field, response.text)
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error" and error["param"] == field, (field, error)
                assert field in error["message"]
        # A body that is not UTF-8 at all is refused too.
        response = http.post(f"{base}/completions", data=b'{"model": "llama", "prompt": "\xff"}',
                             headers={"content-type": "application/json"}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
        # A wrong method is the client's mistake, in OpenAI's shape, with the methods allowed.
        response = http.get(f"{base}/completions", timeout=30)
        assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"
        assert "POST" in response.headers.get("allow", "")
    replica_reports(idle_and_whole)
    assert client(server).completions.create(model="llama", prompt="x", max_tokens=2).usage.completion_tokens >= 1


def grpc_stub(server) -> tuple[pb_grpc.RaypagedServiceStub, grpc.Channel]:
    channel = grpc.insecure_channel(f"127.0.0.1:{server['grpc']}")
    return pb_grpc.RaypagedServiceStub(channel), channel


APP_METADATA = (("application", APP),)  # which Serve application the proxy routes to


def test_grpc_through_serve_proxy(server, oracle):
    stub, channel = grpc_stub(server)
    with channel:
        token_ids, text, usage = [], "", None
        request = pb.GenerateRequest(prompt=PROMPTS[2], sampling_params=pb.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        for response in stub.Generate(request, metadata=APP_METADATA, timeout=60):
            for delta in response.outputs:
                token_ids.extend(delta.token_ids)
                text += delta.text
            if response.HasField("usage"):
                usage = response.usage
        assert token_ids == oracle["outputs"][2].token_ids and text == oracle["outputs"][2].text
        assert usage.completion_tokens == MAX_TOKENS
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=APP_METADATA, timeout=30)
        assert info.name == "llama" and info.num_blocks == 64
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Generate(pb.GenerateRequest(prompt=""), metadata=APP_METADATA, timeout=30))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "empty" in raised.value.details()


def test_grpc_requests_sharing_a_prefix_go_to_the_replica_holding_it(server):
    """Serve's request router (serve/prefix_request_router.py) reads the GenerateRequest: once a
    replica's routing stats report the prefix, the later requests with it all land there."""
    stub, channel = grpc_stub(server)
    shared = list(range(3, 3 + 48))  # three blocks of 16
    before = {r["replica"]: r["prefix_cache_hits"] for r in replica_reports(idle_and_whole).values()}
    params = pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with channel:
        for i in range(4):
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=shared + [60 + i], sampling_params=params),
                               metadata=APP_METADATA, timeout=60))
            time.sleep(1.5)  # the replicas' routing stats are polled every second
    after = replica_reports(idle_and_whole)
    gained = sorted(after[r]["prefix_cache_hits"] - before.get(r, 0) for r in after)
    assert gained == [0, 3 * 48], gained  # the 2nd to 4th requests hit, all on one replica


MALFORMED = [b"\x12\x04\xff\xfe\xc0\xaf", b"\xff" * 16, b"\x12\x7fabc",
             b"\x0a\x03\xed\xa0\x80"]  # the last: request_id holding a surrogate's UTF-8-like bytes


def test_malformed_bytes_through_serve_proxy_are_invalid_argument(server):
    """Issue 24: Serve's gRPC ingress answered UNKNOWN (an unexpected DecodeError) to bytes that
    do not parse, where `raypaged launch` answers INVALID_ARGUMENT; every method, both doors."""
    _, channel = grpc_stub(server)
    with channel:
        generate = channel.unary_stream("/raypaged.v1.RaypagedService/Generate")
        abort = channel.unary_unary("/raypaged.v1.RaypagedService/Abort")
        model_info = channel.unary_unary("/raypaged.v1.RaypagedService/GetModelInfo")
        # (An AbortRequest skips the unknown field 2, a GetModelInfoRequest every field: those
        # bytes parse for them.)
        for call, cases in ((lambda d: list(generate(d, metadata=APP_METADATA, timeout=30)), MALFORMED),
                            (lambda d: abort(d, metadata=APP_METADATA, timeout=30), MALFORMED[1:]),
                            (lambda d: model_info(d, metadata=APP_METADATA, timeout=30), MALFORMED[1:3])):
            for data in cases:
                with pytest.raises(grpc.RpcError) as raised:
                    call(data)
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (data, raised.value)
                assert "not a valid message" in raised.value.details()
    replica_reports(idle_and_whole)


def test_two_replicas_both_serve(server):
    def post(i: int) -> requests.Response:
        body = {"model": "llama", "prompt": PROMPTS[i % 3], "max_tokens": 6}
        return requests.post(f"{server['base']}/v1/completions", json=body, timeout=60)

    seen: set[str] = set()
    for _ in range(5):  # Serve picks replicas by queue length: a burst spreads over both
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(post, range(8)))
        assert all(r.status_code == 200 for r in responses)
        seen |= {r.headers["x-raypaged-replica"] for r in responses}
        if len(seen) == 2:
            break
    assert len(seen) == 2


def test_client_disconnect_aborts(server):
    body = {"model": "llama", "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with requests.post(f"{server['base']}/v1/completions", json=body, stream=True, timeout=30) as response:
        replica = response.headers["x-raypaged-replica"]
        first = next(line for line in response.iter_lines() if line)
        assert first.startswith(b"data: ")
    # Leaving the block closes the connection mid-stream.
    reports = replica_reports(idle_and_whole)
    assert replica in reports
    metrics = _replica_metrics(replica)
    aborted = metrics[("raypaged_request_success", "abort")]
    assert aborted >= 1


def _replica_metrics(replica: str) -> dict[tuple[str, str], float]:
    handle = serve.get_app_handle(APP)
    for _ in range(100):
        text = handle.metrics_text.remote().result()
        if f'engine="{replica}"' in text:
            values = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    values[(family.name, sample.labels.get("finished_reason", ""))] = sample.value
            return values
    raise AssertionError(f"replica {replica} never answered")


def test_every_replicas_metrics_reach_prometheus(server):
    """Ray's node metrics port (what Prometheus scrapes) carries both replicas' series."""
    url = f"http://127.0.0.1:{server['metrics']}/metrics"
    deadline = time.monotonic() + 30
    replicas: set[str] = set()
    while time.monotonic() < deadline:
        text = requests.get(url, timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.name == "ray_raypaged_generation_tokens":
                replicas |= {s.labels["replica"] for s in family.samples if s.value > 0}
        if len(replicas) == 2:
            break
        time.sleep(0.5)
    assert len(replicas) == 2
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
        [call] = _named_call(api).choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SWITCH["function"]["parameters"])
    finally:
        serve.delete("tp2")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and set(live_placement_groups()) != groups_before:
        time.sleep(0.2)
    assert set(live_placement_groups()) == groups_before

SWITCH = {"type": "function", "function": {"name": "switch", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}}}


def _named_call(api: openai.OpenAI):
    return api.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "Lights on?"}], max_tokens=40, temperature=0.0,
        tools=[SWITCH], tool_choice={"type": "function", "function": {"name": "switch"}})


def test_tool_calls_through_the_serve_app(server):
    """A named choice is enforced (the arguments validate) and streams the same; auto reaches the
    hermes parser the app's args name."""
    whole = _named_call(client(server))
    [call] = whole.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SWITCH["function"]["parameters"])
    assert whole.choices[0].finish_reason == "tool_calls"
    auto = client(server).chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "Lights on?"}], max_tokens=4, temperature=0.0,
        tools=[SWITCH])
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


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


def test_shutdown_leaves_no_actors(server):
    serve.shutdown()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (live_actors() or live_placement_groups()):
        time.sleep(0.2)
    assert live_actors() == [] and live_placement_groups() == []

