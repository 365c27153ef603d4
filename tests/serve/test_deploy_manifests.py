"""The deploy/ manifests: the Serve configs and the KubeRay manifest valid against Ray's schemas
and sized for a replica, the cluster config, and the Grafana dashboard's metric names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from prometheus_client import generate_latest
from ray.serve.schema import ServeDeploySchema

from raypaged.frontend.metrics import FrontendMetrics
from raypaged.serve import GRPC_SERVICER_FUNCTION, ServeAppArgs, deployment_options

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


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
