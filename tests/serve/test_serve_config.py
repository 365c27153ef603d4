"""raypaged.serve's settings without a cluster: the app's arguments, placement bundles, autoscaling
and deployment options, served model names. The deploy/ manifests: test_deploy_manifests.py; the
OpenAI side: test_openai_requests.py, test_openai_responses.py."""

from __future__ import annotations

import pytest

from raypaged.config import ConfigError, EngineConfig
from raypaged.serve import ServeAppArgs, deployment_options, ingress_options
from raypaged.serve.openai_errors import model_not_found
from raypaged.serve.placement import replica_bundles


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
