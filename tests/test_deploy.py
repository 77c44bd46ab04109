"""``deploy/`` is valid offline: the Kubernetes manifests against the Kubernetes schemas
(kubernetes-validate), the compose file against the Compose Specification (the schema
check-jsonschema ships), and the Grafana dashboard asks only for metrics the server
exports."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from stargrpc import metrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
#: Resource kinds of custom resource definitions, which no Kubernetes schema covers.
CUSTOM = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def manifests() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found.append((f"{path.name}:{document['kind']}", document))
    return found


@pytest.mark.parametrize(("name", "manifest"), manifests(), ids=lambda v: v if
                         isinstance(v, str) else "")
def test_kubernetes_manifests_match_the_kubernetes_schemas(name: str,
                                                           manifest: dict[str, Any]) -> None:
    if (manifest["apiVersion"], manifest["kind"]) in CUSTOM:
        assert manifest["spec"]["endpoints"][0]["port"] == "metrics"
        return
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


def test_every_resource_kubernetes_needs_is_there() -> None:
    kinds = {manifest["kind"] for _, manifest in manifests()}
    assert kinds == {"ConfigMap", "Secret", "Deployment", "Service", "PodDisruptionBudget",
                     "HorizontalPodAutoscaler", "ServiceMonitor"}


def test_the_deployment_drains_within_its_grace_period_and_runs_unprivileged() -> None:
    by_kind = {manifest["kind"]: manifest for _, manifest in manifests()}
    config = by_kind["ConfigMap"]["data"]
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    drain = (pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
             + float(config["STARGRPC_SHUTDOWN_GRACE_SECONDS"])
             + float(config["STARGRPC_AUDIT_CLOSE_TIMEOUT_SECONDS"]) + 2)
    assert drain < pod["terminationGracePeriodSeconds"]
    assert container["readinessProbe"]["grpc"]["port"] == int(config["STARGRPC_PORT"])
    assert container["livenessProbe"]["grpc"]["port"] == int(config["STARGRPC_PORT"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "Localhost"
    service = by_kind["Service"]["spec"]
    assert service["clusterIP"] == "None"  # headless: client-side round_robin


def test_compose_file_matches_the_compose_specification() -> None:
    schema = json.loads(resources.files("check_jsonschema.builtin_schemas.vendor")
                        .joinpath("compose-spec.json").read_text())
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    jsonschema.validate(compose, schema, cls=jsonschema.Draft202012Validator)
    assert compose["services"]["stargrpc"]["deploy"]["replicas"] == 2
    assert {"redis", "postgres", "prometheus", "grafana"} <= set(compose["services"])


def exported_series() -> set[str]:
    """Every series name the server's metrics produce (counters with ``_total``,
    histograms with ``_bucket``/``_sum``/``_count``)."""
    names = set()
    for family in metrics.REGISTRY.collect():
        suffixes = {"counter": ["_total", "_created"],
                    "histogram": ["_bucket", "_sum", "_count", "_created"],
                    "gauge": [""]}[family.type]
        names.update(family.name + suffix for suffix in suffixes)
    return names


def test_the_dashboard_queries_only_metrics_the_server_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "stargrpc.json").read_text())
    exported = exported_series()
    expressions = [target["expr"] for panel in dashboard["panels"]
                   for target in panel["targets"]]
    assert len(expressions) >= 7
    for expression in expressions:
        used = set(re.findall(r"\b(tool_executor_[a-z_]+)\b", expression))
        assert used, expression
        assert used <= exported, (expression, used - exported)


def test_prometheus_scrapes_the_port_the_replicas_serve_metrics_on() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    scrape = prometheus["scrape_configs"][0]["dns_sd_configs"][0]
    assert scrape["names"] == ["stargrpc"]
    assert str(scrape["port"]) == compose["services"]["stargrpc"]["environment"][
        "STARGRPC_METRICS_PORT"]


def test_the_validators_reject_a_misspelt_field() -> None:
    deployment = yaml.safe_load((KUBERNETES / "deployment.yaml").read_text())
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"][
        "prot"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(),
                                     strict=True)
    schema = json.loads(resources.files("check_jsonschema.builtin_schemas.vendor")
                        .joinpath("compose-spec.json").read_text())
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    compose["services"]["redis"]["imag"] = "redis"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(compose, schema, cls=jsonschema.Draft202012Validator)
