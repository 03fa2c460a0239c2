"""deploy/kubernetes/: every manifest against the Kubernetes schemas (kubernetes-validate, the
`test` extra), and the manifests against each other and against ringserve itself.

Built-in kinds (Deployment, Service, HPA, RBAC, ConfigMap, PVC) are validated strictly against
the newest schemas kubernetes-validate ships. The custom resources (ServiceMonitor, InferencePool,
HTTPRoute) have no schema in it and none can be fetched here: they are parsed and checked for the
fields their CRDs require, and for what they point at (labels, ports, the Deployment)."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from ringserve.server.launch import add_serve_arguments
from ringserve.server.metrics import CacheConfig, EngineSnapshot, RequestMetrics, render

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the `test` extra "
                         "(make test installs it)")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
CUSTOM = {  # kind -> fields its CRD requires (dotted paths)
    "ServiceMonitor": ["metadata.name", "spec.selector", "spec.endpoints"],
    "InferencePool": ["metadata.name", "spec.selector.matchLabels", "spec.targetPorts",
                      "spec.endpointPickerRef.name", "spec.endpointPickerRef.port.number"],
    "HTTPRoute": ["metadata.name", "spec.parentRefs", "spec.rules"],
}


def _docs() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def _get(doc: dict, dotted: str):
    for key in dotted.split("."):
        doc = doc[key]
    return doc


DOCS = _docs()
SERVER = DOCS[("Deployment", "ringserve")]
POD = SERVER["spec"]["template"]
CONTAINER = POD["spec"]["containers"][0]


@pytest.mark.parametrize("key", sorted(DOCS), ids=lambda k: f"{k[0]}/{k[1]}")
def test_every_manifest_is_valid(key):
    doc = DOCS[key]
    if doc["kind"] in CUSTOM:
        with pytest.raises(kv.SchemaNotFoundError):  # if it ever ships one, use it instead
            kv.validate(doc, kv.latest_version(), strict=True)
        for field in CUSTOM[doc["kind"]]:
            assert _get(doc, field), (key, field)
    else:
        kv.validate(doc, kv.latest_version(), strict=True)


def test_the_validator_catches_a_bad_manifest():
    bad = yaml.safe_load(yaml.safe_dump(SERVER))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)


def _serve_flags() -> argparse.Namespace:
    assert CONTAINER["command"] == ["ringserve", "serve"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    return parser.parse_args(CONTAINER["args"])  # ringserve's own parser: real flags only


def test_the_server_deployment():
    args = _serve_flags()
    labels = POD["metadata"]["labels"]
    assert SERVER["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert CONTAINER["resources"]["limits"]["nvidia.com/gpu"] == 1 and args.engines == 1
    ports = {p["name"]: p["containerPort"] for p in CONTAINER["ports"]}
    assert ports["http"] == args.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert CONTAINER[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # SIGKILL only after the preStop pause and the whole drain, with room to stop the engines
    pause = CONTAINER["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert POD["spec"]["terminationGracePeriodSeconds"] >= pause + args.drain_timeout + 5
    assert {"mountPath": "/dev/shm", "name": "shm"} in CONTAINER["volumeMounts"]


def test_what_points_at_the_pods():
    labels = POD["metadata"]["labels"]
    service = DOCS[("Service", "ringserve")]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    monitor = DOCS[("ServiceMonitor", "ringserve")]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    hpa = DOCS[("HorizontalPodAutoscaler", "ringserve")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "ringserve"}
    pool = DOCS[("InferencePool", "ringserve")]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": _serve_flags().port}]
    route = DOCS[("HTTPRoute", "ringserve")]
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == "ringserve"
    router = DOCS[("Deployment", "ringserve-router")]["spec"]["template"]["spec"]["containers"][0]
    selector = router["args"][router["args"].index("--selector") + 1]
    key, value = selector.split("=")
    assert labels[key] == value and "--service-discovery-port=8000" in router["args"]


def _page(prefix: str) -> str:
    return render(RequestMetrics("m", 256, prefix), "m", [EngineSnapshot(1, 2, 0.5)],
                  CacheConfig(16, 100)).decode()


def test_the_endpoint_picker_reads_names_ringserve_serves():
    """The engineConfigs entry names metrics that ringserve's /metrics really has, and the pods
    carry the engine-type label it is chosen by."""
    config = yaml.safe_load(DOCS[("ConfigMap", "ringserve-epp-config")]["data"]["ringserve-epp.yaml"])
    extractor, = (p for p in config["plugins"] if p["type"] == "core-metrics-extractor")
    params = extractor["parameters"]
    entry, = params["engineConfigs"]
    assert POD["metadata"]["labels"][params["engineLabelKey"]] == entry["name"]
    page = _page(_serve_flags().metrics_prefix)
    specs = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec")
    for spec in specs:
        assert f"\n{entry[spec]}{{" in page, (spec, entry[spec])
    # with --metrics-prefix vllm the extractor's built-in vllm entry reads the same gauges
    vllm = _page("vllm")
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc",
                 "cache_config_info"):
        assert f"\nvllm:{name}{{" in vllm
    # the HPA's metric is one the server has, under the adapter's rename (hpa.yaml)
    hpa = DOCS[("HorizontalPodAutoscaler", "ringserve")]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "ringserve_num_requests_waiting"
    assert "\nringserve:num_requests_waiting{" in page
