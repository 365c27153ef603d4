"""raypaged.serve without a cluster: arguments, placement bundles, autoscaling options, the
deploy/ manifests, the OpenAI request → raypaged.v1 mapping, response shaping, chat template,
error bodies, and the Grafana dashboard's metric names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import jsonschema
import pytest
import ray
import yaml
from prometheus_client import generate_latest
from ray.serve.schema import ServeDeploySchema

from raypaged.config import ConfigError, EngineConfig
from raypaged.core.errors import InvalidRequestError, QueueFullError
from raypaged.engine.client import EngineDeadError
from raypaged.frontend.metrics import FrontendMetrics
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.serve import GRPC_SERVICER_FUNCTION, ServeAppArgs, deployment_options, ingress_options
from raypaged.serve.chat_template import DEFAULT_CHAT_TEMPLATE, chat_prompt_token_ids
from raypaged.serve.openai_errors import OpenAIError, from_validation_errors, model_not_found
from raypaged.serve.openai_protocol import ChatCompletionRequest, CompletionRequest
from raypaged.serve.openai_responses import MIN_LOGPROB, ResponseBuilder
from raypaged.serve.placement import replica_bundles
from tests.support.checkpoints import checkpoint_dir

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


# ---- arguments, placement, deployment options ---------------------------------------------------
def test_args_split_engine_and_deployment_settings():
    args = ServeAppArgs.from_dict({"model": "/m", "tensor_parallel_size": 2, "block_size": 32,
                                   "num_replicas": 3, "served_model_name": "m",
                                   "limits": {"max_n": 4}})
    assert args.engine == EngineConfig(model="/m", tensor_parallel_size=2, block_size=32,
                                       max_waiting_requests=1024)
    assert (args.num_replicas, args.served_model_name, args.limits.max_n) == (3, "m", 4)


@pytest.mark.parametrize("raw, message", [
    ({"modle": "/m"}, "unknown raypaged.serve argument"),
    ({"limits": {"max_q": 1}}, "unknown limits"),
    ({"autoscaling": {"max_replica": 2}}, "unknown autoscaling"),
    ({"autoscaling": 3}, "must be a mapping"),
    ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas <= max_replicas"),
    ({"autoscaling": {"target_ongoing_requests": 500}}, "target_ongoing_requests"),
    ({"num_replicas": 0}, "num_replicas"),
    ({"block_size": 12}, "block_size"),
    ({"replica_num_cpus": -1}, "replica_num_cpus"),
])
def test_bad_args_are_refused(raw, message):
    with pytest.raises(ConfigError, match=message):
        ServeAppArgs.from_dict(raw)


@pytest.mark.parametrize("engine, use_gpu, expected", [
    (EngineConfig(), False, [{"CPU": 0.5}]),
    (EngineConfig(), True, [{"CPU": 0.5}, {"CPU": 1.0, "GPU": 1.0}]),
    (EngineConfig(tensor_parallel_size=2), True, [{"CPU": 0.5}] + [{"CPU": 1.0, "GPU": 1.0}] * 2),
    (EngineConfig(tensor_parallel_size=4), False, [{"CPU": 0.5}] + [{"CPU": 0.25}] * 4),
    (EngineConfig(tensor_parallel_size=2, ray_cpus_per_worker=3.0), True,
     [{"CPU": 0.5}] + [{"CPU": 3.0, "GPU": 1.0}] * 2),
    (EngineConfig(distributed_executor_backend="ray"), False, [{"CPU": 0.5}, {"CPU": 0.25}]),
])
def test_replica_bundles(engine, use_gpu, expected):
    assert replica_bundles(engine, 0.5, use_gpu) == expected


def test_autoscaling_on_queue_length():
    args = ServeAppArgs.from_dict({"autoscaling": {"min_replicas": 1, "max_replicas": 4,
                                                   "target_ongoing_requests": 32},
                                   "max_ongoing_requests": 128, "device": "cpu"})
    options = deployment_options(args, cluster_gpus=0)
    assert "num_replicas" not in options
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["target_ongoing_requests"]) == (1, 4, 32)
    assert options["max_ongoing_requests"] == 128
    fixed = deployment_options(ServeAppArgs.from_dict({"num_replicas": 2}), cluster_gpus=0)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed


def test_device_auto_follows_the_cluster():
    args = ServeAppArgs.from_dict({"tensor_parallel_size": 2})
    assert deployment_options(args, cluster_gpus=8)["placement_group_bundles"][1] == {"CPU": 1.0, "GPU": 1.0}
    assert deployment_options(args, cluster_gpus=0)["placement_group_bundles"][1] == {"CPU": 0.25}
    cuda = ServeAppArgs.from_dict({"tensor_parallel_size": 2, "device": "cuda"})
    assert deployment_options(cuda, cluster_gpus=0)["placement_group_bundles"][2]["GPU"] == 1.0


def test_build_app_pins_the_device_its_bundles_reserve():
    from raypaged.serve import build_app

    app = build_app({"model": "/m"})  # no Ray here and no GPU: a CPU replica
    ingress = app._bound_deployment
    args, engines = ingress.init_args
    assert args.engine.model_settings.device == "cpu"
    # The ingress holds no placement group; the engine deployment's replica reserves its own.
    assert ingress._replica_config.placement_group_bundles is None
    router = ingress._deployment_config.request_router_config.request_router_class
    assert router.endswith("PowerOfTwoChoicesRequestRouter")
    engine = engines._bound_deployment if hasattr(engines, "_bound_deployment") else engines
    assert engine._replica_config.placement_group_bundles == [{"CPU": 1.0}]
    assert engine.name == "raypaged_engine" and ingress.name == "raypaged"


def test_the_engines_route_by_prefix_and_the_ingress_scales_apart():
    args = ServeAppArgs.from_dict({"num_replicas": 3, "ingress_num_replicas": 2, "ingress_num_cpus": 0.5})
    engines = deployment_options(args, cluster_gpus=0)
    # One engine replica too: a retry must avoid the replica it lost (serve/route_hint.py).
    one = deployment_options(ServeAppArgs.from_dict({}), cluster_gpus=0)
    for options in (engines, one):
        assert options["request_router_config"].request_router_class.endswith("PrefixAwareRequestRouter")
    assert engines["num_replicas"] == 3
    ingress = ingress_options(args)
    assert (ingress["num_replicas"], ingress["ray_actor_options"]) == (2, {"num_cpus": 0.5})
    assert "placement_group_bundles" not in ingress
    for bad in ({"ingress_num_replicas": 0}, {"ingress_num_cpus": -1}, {"replica_recovery_timeout_s": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            ServeAppArgs.from_dict(bad)


# ---- deploy/ ------------------------------------------------------------------------------------
def _serve_configs() -> list[tuple[str, dict]]:
    demo = yaml.safe_load((DEPLOY / "serve_demo.yaml").read_text())
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay" / "rayservice.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "RayService")
    return [("demo", demo), ("kuberay", yaml.safe_load(service["spec"]["serveConfigV2"]))]


@pytest.mark.parametrize("name, config", _serve_configs())
def test_serve_configs_are_valid(name, config):
    schema = ServeDeploySchema.model_validate(config)
    assert schema.grpc_options.grpc_servicer_functions == [GRPC_SERVICER_FUNCTION]
    (app,) = schema.applications
    assert app.import_path == "raypaged.serve:build_app"
    args = ServeAppArgs.from_dict(app.args)
    options = deployment_options(args, cluster_gpus=0)
    assert options["autoscaling_config"]["target_ongoing_requests"] > 0  # scales on queue length
    if name == "kuberay":  # GPU workers: one GPU bundle per TP rank
        tp = args.engine.parallel.tensor_parallel_size
        assert [b.get("GPU", 0) for b in options["placement_group_bundles"]] == [0] + [1.0] * tp


def test_kuberay_worker_pods_fit_a_replica():
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay" / "rayservice.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "RayService")
    args = ServeAppArgs.from_dict(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])
    bundles = deployment_options(args, cluster_gpus=0)["placement_group_bundles"]
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    # STRICT_PACK: a replica's bundles must fit on one pod.
    assert int(limits["nvidia.com/gpu"]) >= sum(b.get("GPU", 0) for b in bundles)
    assert float(limits["cpu"]) >= sum(b["CPU"] for b in bundles)
    assert any(d["kind"] == "PodMonitor" for d in docs)


def test_cluster_config_matches_rays_schema():
    config = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    assert config["head_node_type"] in config["available_node_types"]
    assert any("raypaged[serve]" in command for command in config["setup_commands"])


def test_grafana_dashboard_uses_only_real_metrics():
    dashboard = json.loads((DEPLOY / "grafana" / "raypaged.json").read_text())
    metrics = FrontendMetrics("m", 256)
    metrics.record_error("INVALID_ARGUMENT")  # a family labelled per call has no series before
    metrics.record_tenant_admitted("t", 1)
    metrics.record_tenant_tokens("t", 1)
    metrics.record_tenant_refused("t", "max_concurrent")
    metrics.record_tenant_in_flight("t", 0)
    exported = set()
    for line in generate_latest(metrics.registry).decode().splitlines():
        if not line.startswith("#"):
            exported.add(line.split("{")[0].split(" ")[0])
    names_in_exprs = set()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names_in_exprs |= set(re.findall(r'"\(ray_\)\?(raypaged_\w+)"', target["expr"]))
    assert names_in_exprs and names_in_exprs <= exported, names_in_exprs - exported
    # The dashboard shows every family the frontend has (except the n histogram and raw block
    # gauges' duplicates): at least these.
    for must in ("raypaged_time_to_first_token_seconds_bucket", "raypaged_kv_cache_unfilled_slots",
                 "raypaged_request_errors_total", "raypaged_num_requests_waiting"):
        assert must in names_in_exprs
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


# ---- OpenAI requests → raypaged.v1 ---------------------------------------------------------------
def test_completion_request_maps_every_field():
    body = CompletionRequest.model_validate({
        "model": "m", "prompt": ["hello"], "max_tokens": 7, "n": 2, "temperature": 0.5, "top_p": 0.9,
        "presence_penalty": 0.1, "frequency_penalty": 0.2, "seed": 3, "stop": "\n", "logprobs": 2,
        "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 1, "stop_token_ids": [9],
        "ignore_eos": True, "skip_special_tokens": False, "priority": 4, "cache_salt": "s",
        "request_id": "r1", "user": "ignored", "unknown_field": 1})
    message = body.to_generate_request()
    params = message.sampling_params
    assert (message.prompt, message.request_id, message.priority, message.cache_salt) == ("hello", "r1", 4, "s")
    assert (params.max_tokens, params.n, params.seed, params.logprobs, params.top_k,
            params.min_tokens) == (7, 2, 3, 2, 5, 1)
    assert params.temperature == pytest.approx(0.5) and params.min_p == pytest.approx(0.05)
    assert list(params.stop) == ["\n"] and list(params.stop_token_ids) == [9]
    assert params.ignore_eos and not params.skip_special_tokens
    # Unset stays unset: validation then applies vLLM's defaults.
    bare = CompletionRequest.model_validate({"prompt": [1, 2, 3]}).to_generate_request()
    assert list(bare.prompt_token_ids) == [1, 2, 3] and bare.request_id
    assert not bare.sampling_params.HasField("max_tokens") and not bare.sampling_params.HasField("temperature")


def test_chat_request_maps_max_completion_tokens_and_logprobs():
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_tokens": 5, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3})
    assert body.message_dicts() == [{"role": "user", "content": "ab"}]
    message = body.to_generate_request([4, 5])
    assert list(message.prompt_token_ids) == [4, 5]
    assert message.sampling_params.max_tokens == 9 and message.sampling_params.logprobs == 3
    plain = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert not plain.to_generate_request([1]).sampling_params.HasField("logprobs")


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logit_bias": {"one": 2.0}}, "logit_bias keys must be token ids"),
    ({"prompt": "x", "logit_bias": {"4294967296": 2.0}}, "not a token id"),
    ({"prompt": [[1], [2]]}, "one prompt"),
])
def test_unsupported_completion_features_are_refused(body, message):
    with pytest.raises(InvalidRequestError, match=message):
        CompletionRequest.model_validate(body).to_generate_request()


def test_logit_bias_and_prompt_logprobs_reach_the_message():
    body = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"7": -100, " 3": 2.5},
                                             "echo": True, "logprobs": 2})
    params = body.to_generate_request().sampling_params
    assert dict(params.logit_bias) == {7: -100.0, 3: 2.5}
    assert params.prompt_logprobs == 2 and params.logprobs == 2  # echo with logprobs scores the prompt
    asked = CompletionRequest.model_validate({"prompt": "x", "prompt_logprobs": 4, "echo": True, "logprobs": 1})
    assert asked.to_generate_request().sampling_params.prompt_logprobs == 4
    plain = CompletionRequest.model_validate({"prompt": "x", "echo": True}).to_generate_request()
    assert not plain.sampling_params.HasField("prompt_logprobs") and not plain.sampling_params.logit_bias
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "logit_bias": {"5": 1}})
    assert dict(chat.to_generate_request([1]).sampling_params.logit_bias) == {5: 1.0}


@pytest.mark.parametrize("extra, message", [
    ({"tools": [{"type": "function"}]}, r"tools\[0\].function must be an object"),
    ({"tool_choice": "auto"}, "tool_choice 'auto' needs a non-empty tools list"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "--enable-auto-tool-choice"),
    ({"response_format": {"type": "xml"}}, "response_format type .xml. is not supported"),
    ({"response_format": {"type": "json_schema"}}, "needs a json_schema object"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
])
def test_unsupported_chat_features_are_refused(extra, message):
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **extra})
    with pytest.raises(InvalidRequestError, match=message):
        body.to_generate_request([1])


def test_wire_limits_are_validation_errors():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": 2**31})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": [2**40]})


# ---- chat template -------------------------------------------------------------------------------
def test_default_chat_template_when_the_tokenizer_has_none():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir("llama")))
    assert not getattr(tokenizer, "chat_template", None)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = chat_prompt_token_ids(tokenizer, messages, max_chars=1000)
    assert ids == tokenizer.encode("system: be brief\nuser: hi\nassistant:")
    with pytest.raises(InvalidRequestError, match="characters"):
        chat_prompt_token_ids(tokenizer, messages, max_chars=5)
    # The tokenizer's own template wins, and writes its special tokens itself.
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    assert chat_prompt_token_ids(tokenizer, messages, 1000) == tokenizer.encode(
        "<system>be brief<user>hi", add_special_tokens=False)
    tokenizer.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(InvalidRequestError, match="no system role"):
        chat_prompt_token_ids(tokenizer, messages, 1000)
    assert "add_generation_prompt" in DEFAULT_CHAT_TEMPLATE


# ---- responses -----------------------------------------------------------------------------------
class _Tokenizer:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def _messages() -> list[pb.GenerateResponse]:
    return [
        pb.GenerateResponse(outputs=[pb.CompletionDelta(index=0, token_ids=[5], text="He")]),
        pb.GenerateResponse(outputs=[pb.CompletionDelta(index=0, token_ids=[6], text="")]),  # held back
        pb.GenerateResponse(outputs=[pb.CompletionDelta(index=0, token_ids=[7], text="llo",
                                                        finish_reason=pb.FINISH_REASON_STOP, stop_string="!")],
                            usage=pb.Usage(prompt_tokens=4, completion_tokens=3, cached_tokens=2)),
    ]


@pytest.mark.parametrize("chat", [False, True])
def test_stream_chunks_and_usage(chat):
    builder = ResponseBuilder(chat=chat, request_id="r", model="m", tokenizer=_Tokenizer(), n=1,
                              logprobs=False, include_usage=False)
    chunks = [c for m in _messages() for c in builder.chunks(m)]
    assert len(chunks) == 2  # the held-back delta sends nothing
    if chat:
        assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["id"] == "chatcmpl-r"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
        assert chunks[1]["choices"][0]["delta"] == {"content": "llo"}
    else:
        assert [c["choices"][0]["text"] for c in chunks] == ["He", "llo"]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["stop_reason"] == "!"
    assert last["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert chunks[0]["usage"] is None


def test_include_usage_sends_openais_usage_chunk():
    builder = ResponseBuilder(chat=True, request_id="r", model="m", tokenizer=_Tokenizer(), n=1,
                              logprobs=False, include_usage=True)
    chunks = [c for m in _messages() for c in builder.chunks(m)]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 7
    assert all(c["usage"] is None for c in chunks[:-1])


def test_accumulated_response_with_logprobs():
    lp = [pb.TokenLogprobs(token_id=5, logprob=-0.5, top_logprobs=[pb.TopLogprob(token_id=5, logprob=-0.5),
                                                                   pb.TopLogprob(token_id=9, logprob=float("-inf"))])]
    messages = [
        pb.GenerateResponse(outputs=[pb.CompletionDelta(index=1, token_ids=[5], text="a", logprobs=lp)]),
        pb.GenerateResponse(outputs=[pb.CompletionDelta(index=0, token_ids=[5], text="b", logprobs=lp,
                                                        finish_reason=pb.FINISH_REASON_LENGTH)]),
        pb.GenerateResponse(outputs=[pb.CompletionDelta(index=1, token_ids=[5], text="c", logprobs=lp,
                                                        finish_reason=pb.FINISH_REASON_STOP, stop_token_id=2)],
                            usage=pb.Usage(prompt_tokens=1, completion_tokens=3)),
    ]
    completion = ResponseBuilder(chat=False, request_id="r", model="m", tokenizer=_Tokenizer(), n=2,
                                 logprobs=True, include_usage=False)
    chat = ResponseBuilder(chat=True, request_id="r", model="m", tokenizer=_Tokenizer(), n=2,
                           logprobs=True, include_usage=False)
    for message in messages:
        completion.add(message)
        chat.add(message)
    body = completion.response()
    assert [c["text"] for c in body["choices"]] == ["b", "ac"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["choices"][1]["stop_reason"] == 2
    logprobs = body["choices"][1]["logprobs"]
    assert logprobs["tokens"] == ["<5>", "<5>"] and logprobs["text_offset"] == [0, 3]
    assert logprobs["top_logprobs"][0] == {"<5>": -0.5, "<9>": MIN_LOGPROB}  # JSON has no -inf
    json.dumps(body, allow_nan=False)
    chat_body = chat.response()
    assert chat_body["choices"][1]["message"] == {"role": "assistant", "content": "ac"}
    entry = chat_body["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "<5>" and entry["bytes"] == list(b"<5>") and len(entry["top_logprobs"]) == 2


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("error, status, kind", [
    (InvalidRequestError("bad"), 400, "invalid_request_error"),
    (QueueFullError("full"), 429, "rate_limit_error"),
    (EngineDeadError("gone"), 503, "service_unavailable_error"),
    (RuntimeError("boom"), 500, "server_error"),
])
def test_exceptions_map_to_openai_errors(error, status, kind):
    refusal = OpenAIError.from_exception(error)
    assert refusal.status == status
    body = refusal.body()["error"]
    assert body["type"] == kind and str(error) in body["message"]
    assert set(body) == {"message", "type", "param", "code"}


def test_model_not_found_and_validation_errors():
    missing = model_not_found("gpt-4", "llama")
    assert (missing.status, missing.code, missing.param, missing.grpc_code) == (
        404, "model_not_found", "model", grpc.StatusCode.NOT_FOUND)
    refusal = from_validation_errors([{"loc": ("body", "temperature"), "msg": "not a number"},
                                      {"loc": ("body", "prompt"), "msg": "Field required"}])
    assert refusal.status == 400 and refusal.param == "temperature"
    assert refusal.message == "temperature: not a number; prompt: Field required"


def test_several_served_model_names():
    from raypaged.cli import build_parser

    args = ServeAppArgs.from_dict({"served_model_name": ["main", "alias"]})
    assert args.served_model_names == ["main", "alias"]
    assert ServeAppArgs.from_dict({"served_model_name": "one"}).served_model_names == ["one"]
    assert ServeAppArgs.from_dict({}).served_model_names == []
    with pytest.raises(ConfigError, match="served_model_name"):
        ServeAppArgs.from_dict({"served_model_name": []})
    for command in ("serve", "launch"):
        parsed = build_parser().parse_args([command, "--served-model-name", "main", "alias"])
        assert parsed.served_model_name == ["main", "alias"]
    assert "`a`, `b`" in model_not_found("x", ["a", "b"]).message
