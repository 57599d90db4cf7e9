"""deploy/kubernetes/: valid against the Kubernetes schema, and consistent with the code they run.

The schema check is kubernetes-validate's (the OpenAPI schema of a Kubernetes release, bundled
with the package, strict: unknown fields are errors). The rest checks what a schema cannot:
that every flag exists in the command it is passed to, that Services and disruption budgets
select the pods they are meant for, that probes name ports the containers have.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from executor_svc.cli import build_parser as executor_parser
from frontend_svc.cli import build_parser as frontend_parser
from scheduler_svc.cli import build_parser as scheduler_parser

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").rglob("*.yaml"))
K8S_VERSION = "1.33.0"  # a release current clusters run; native gRPC probes are GA since 1.27
PARSERS = {
    "llmserve-executor": executor_parser,
    "llmserve-scheduler": scheduler_parser,
    "llmserve-frontend": frontend_parser,
}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base_resources() -> list[dict[str, Any]]:
    """What `kubectl apply -f deploy/kubernetes/` creates (the subdirectories are variants)."""
    return [d for p in MANIFESTS if p.parent.name == "kubernetes" for d in documents(p)]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in base_resources() if d["kind"] == kind}


def test_there_are_manifests() -> None:
    kinds = {d["kind"] for d in base_resources()}
    assert {
        "Namespace",
        "StatefulSet",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    } <= kinds


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_valid_against_the_kubernetes_schema(path: Path) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_broken_manifest() -> None:
    # Guards the test above against a validator that accepts anything.
    deployment = dict(by_kind("Deployment")["scheduler"])
    broken = {**deployment, "spec": {**deployment["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def workloads() -> list[dict[str, Any]]:
    return [
        d for p in MANIFESTS for d in documents(p) if d["kind"] in ("Deployment", "StatefulSet")
    ]


@pytest.mark.parametrize("name", ["executor", "scheduler", "frontend", "executor-gpu"])
def test_every_flag_exists_in_the_command_it_is_given_to(name: str) -> None:
    if name == "executor-gpu":
        [workload] = documents(ROOT / "deploy" / "kubernetes" / "gpu" / "executor-gpu.yaml")
    else:
        workload = by_kind("Deployment")[name]
    [container] = workload["spec"]["template"]["spec"]["containers"]
    [command] = container["command"]
    # $(POD_IP) is expanded by the kubelet from the container's env.
    env = {e["name"] for e in container.get("env", [])}
    args = [a.replace("$(POD_IP)", "10.0.0.7") for a in container["args"]]
    assert all(f"$({v})" not in " ".join(container["args"]) for v in env - {"POD_IP"})
    parser = PARSERS[command]()
    parser.exit_on_error = False
    try:
        parsed = parser.parse_args(args)
    except (argparse.ArgumentError, SystemExit) as e:  # pragma: no cover - the failure path
        pytest.fail(f"{command} {shlex.join(args)}: {e}")
    if command == "llmserve-executor":
        assert parsed.redis_url == "redis://redis:6379/0"
        assert parsed.advertise_address == "10.0.0.7:50061"
    if command == "llmserve-scheduler":
        assert parsed.discover_executors and not parsed.executor


def test_services_and_budgets_select_their_pods() -> None:
    pods = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads()}
    for service in by_kind("Service").values():
        selector = service["spec"]["selector"]
        name = service["metadata"]["name"]
        assert selector.items() <= pods[name].items(), name
        [container] = next(w for w in workloads() if w["metadata"]["name"] == name)["spec"][
            "template"
        ]["spec"]["containers"]
        named_ports = {p["name"] for p in container["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in named_ports, (name, port)
    for budget in by_kind("PodDisruptionBudget").values():
        labels = budget["spec"]["selector"]["matchLabels"]
        assert labels.items() <= pods[budget["metadata"]["name"]].items()


def test_probes_use_grpc_health_and_real_ports() -> None:
    for workload in workloads():
        [container] = workload["spec"]["template"]["spec"]["containers"]
        ports = {p["containerPort"] for p in container["ports"]}
        names = {p["name"] for p in container["ports"]}
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            if "grpc" in probe:
                assert probe["grpc"]["port"] in ports, (workload["metadata"]["name"], kind)
            if "httpGet" in probe:
                assert probe["httpGet"]["port"] in names | ports
        assert "readinessProbe" in container, workload["metadata"]["name"]
    executor = by_kind("Deployment")["executor"]["spec"]["template"]["spec"]["containers"][0]
    assert executor["readinessProbe"]["grpc"]["port"] == 50061
    scheduler = by_kind("Deployment")["scheduler"]["spec"]["template"]["spec"]["containers"][0]
    assert scheduler["readinessProbe"]["grpc"]["port"] == 50051


def test_redis_keeps_an_fsynced_append_only_file_on_a_volume() -> None:
    redis = by_kind("StatefulSet")["redis"]
    [container] = redis["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "always"
    [claim] = redis["spec"]["volumeClaimTemplates"]
    [mount] = container["volumeMounts"]
    assert mount["name"] == claim["metadata"]["name"] and mount["mountPath"] == "/data"


def test_a_leader_and_a_standby_scheduler() -> None:
    scheduler = by_kind("Deployment")["scheduler"]["spec"]
    assert scheduler["replicas"] == 2
    [container] = scheduler["template"]["spec"]["containers"]
    parsed = scheduler_parser().parse_args(container["args"])
    assert parsed.leader_election and parsed.redis_url
    # Readiness is gRPC health, which only the leader reports SERVING: the Service follows it.
    assert container["readinessProbe"]["grpc"]["port"] == 50051
    assert by_kind("PodDisruptionBudget")["scheduler"]["spec"]["maxUnavailable"] == 1


def test_the_autoscaler_scales_executors_on_a_metric_the_scheduler_exports() -> None:
    hpa = by_kind("HorizontalPodAutoscaler")["executor"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "executor"
    [metric] = hpa["metrics"]
    name = metric["external"]["metric"]["name"]
    [adapter] = documents(
        ROOT / "deploy" / "kubernetes" / "monitoring" / "prometheus-adapter-config.yaml"
    )
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["externalRules"]
    [rule] = [r for r in rules if r["name"]["as"] == name]
    series = rule["seriesQuery"].split('"')[1]
    metrics_source = (ROOT / "scheduler_svc" / "engine" / "metrics.py").read_text()
    assert f'"{series}"' in metrics_source


def test_gpu_variant_requests_a_gpu() -> None:
    [workload] = documents(ROOT / "deploy" / "kubernetes" / "gpu" / "executor-gpu.yaml")
    [container] = workload["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert workload["metadata"]["name"] == "executor"  # replaces the CPU Deployment


@pytest.mark.parametrize("gpu", [False, True])
def test_executors_drain_within_the_termination_grace_period(gpu: bool) -> None:
    path = ROOT / "deploy" / "kubernetes" / ("gpu/executor-gpu.yaml" if gpu else "executor.yaml")
    workload = next(d for d in documents(path) if d["kind"] == "Deployment")
    pod = workload["spec"]["template"]["spec"]
    [container] = pod["containers"]
    parsed = executor_parser().parse_args(
        [a.replace("$(POD_IP)", "10.0.0.7") for a in container["args"]]
    )
    # The kubelet SIGKILLs at the end of the grace period: drain, then the server's own grace.
    assert 0 < parsed.drain_timeout + parsed.grace < pod["terminationGracePeriodSeconds"]


def test_the_ha_variant_runs_three_redis_and_three_sentinels_kept_through_drains() -> None:
    docs = documents(ROOT / "deploy" / "kubernetes" / "ha" / "redis-ha.yaml")
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    budgets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodDisruptionBudget"}
    scripts = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    for name in ("redis-ha", "redis-sentinel"):
        assert sets[name]["spec"]["replicas"] == 3
        assert services[name]["spec"]["clusterIP"] == "None"  # stable per-pod names
        assert sets[name]["spec"]["serviceName"] == name
        assert budgets[name]["spec"]["maxUnavailable"] == 1
    assert "sentinel monitor mymaster" in scripts["sentinel.sh"]
    assert "--replicaof" in scripts["redis.sh"] and "--appendonly yes" in scripts["redis.sh"]
    # The base layout keeps its single Redis: the HA one is opt-in.
    assert "redis" in by_kind("StatefulSet") and "redis-ha" not in by_kind("StatefulSet")
