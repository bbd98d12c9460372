"""The Kubernetes manifests of deploy/kubernetes/: valid against the Kubernetes API schemas
(kubernetes-validate, which bundles them: no cluster, no network), the server arguments parse
with jaxserve's own parser, the probes, drain and volumes follow docs/configuration.md, and the
two autoscalers (KEDA's ScaledObject, checked structurally, and the HPA) agree and scale up fast
and down slow."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml

from jaxserve.cli.main import build_parser
from jaxserve.config import EngineConfig
from jaxserve.config_args import engine_config_from_args, server_config_from_args
from tests.deploy.queries import ADAPTER, HPA, KEDA, KUBERNETES, instructions, load_yaml

kv = pytest.importorskip("kubernetes_validate",
                         reason="kubernetes-validate is not installed (a test extra)")

BASE = KUBERNETES / "base"
PLAIN = [*sorted(BASE.glob("*.yaml")), KUBERNETES / "prepare-model-job.yaml", HPA]
# 1.30: the first release with the preStop sleep action on by default; and the newest bundled
VERSIONS = ["1.30.0", kv.latest_version()]
# the grace period the drain needs beyond the preStop sleep and --shutdown-timeout: aborted
# requests get up to 5 s to end and open connections up to 5 s more (docs/configuration.md)
DRAIN_GRACE_S = 10


def _documents(paths: list[Path]) -> list[tuple[str, dict]]:
    return [(f"{p.relative_to(KUBERNETES)}:{d['kind']}/{d['metadata']['name']}", d)
            for p in paths if p.name != "kustomization.yaml" for d in load_yaml(p)]


def _rendered(overlay: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for its built-in kustomize) is not installed: the overlay is not "
                    "rendered; the base manifests are checked on their own")
    out = subprocess.run([kubectl, "kustomize", str(overlay)], check=False,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _by_kind(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _base() -> list[dict]:
    return [d for _, d in _documents(sorted(BASE.glob("*.yaml")))]


def _container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("doc", [pytest.param(d, id=w) for w, d in _documents(PLAIN)])
def test_manifest_matches_the_kubernetes_schema(doc: dict, version: str) -> None:
    # strict: an unknown or misspelt field is an error, not silently dropped
    kv.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_gpu_overlay_renders_to_valid_manifests_with_a_gpu(version: str) -> None:
    docs = _rendered(KUBERNETES / "gpu")
    for d in docs:
        kv.validate(d, version, strict=True)
    c = _container(_by_kind(docs, "Deployment"))
    assert c["image"].endswith("-cuda")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    base = _container(_by_kind(_base(), "Deployment"))
    assert c["args"] == base["args"] and c["readinessProbe"] == base["readinessProbe"]


def test_base_kustomization_lists_every_base_manifest() -> None:
    (k,) = load_yaml(BASE / "kustomization.yaml")
    assert sorted(k["resources"]) == sorted(p.name for p in BASE.glob("*.yaml")
                                            if p.name != "kustomization.yaml")


def _server_args(deployment: dict):
    args = _container(deployment)["args"]
    assert args[0] == "serve"
    ns = build_parser().parse_args(args)  # an unknown flag exits here
    return server_config_from_args(ns), engine_config_from_args(ns)


def test_probes_drain_and_keep_alive_follow_the_documented_rule() -> None:
    dep = _by_kind(_base(), "Deployment")
    pod, c = dep["spec"]["template"]["spec"], _container(dep)
    server, _ = _server_args(dep)
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert server.port == port and server.host == "0.0.0.0"
    probes = {k: c[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    for probe in probes.values():
        assert probe["httpGet"]["port"] in ("http", port)
    assert probes["startupProbe"]["httpGet"]["path"] == "/health"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
    start = probes["startupProbe"]
    assert start["failureThreshold"] * start["periodSeconds"] >= 600  # a cold compile
    sleep_s = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert sleep_s >= 1
    assert pod["terminationGracePeriodSeconds"] >= (
        sleep_s + server.shutdown_timeout + DRAIN_GRACE_S)
    # above the common proxy idle pools (nginx, ALB: 60 s; Go: 90 s)
    assert server.timeout_keep_alive > 90
    assert server.metrics_compat == "vllm"
    strategy = dep["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


def test_volumes_are_the_image_paths_and_the_user_the_image_user() -> None:
    base = _base()
    dep = _by_kind(base, "Deployment")
    pod, c = dep["spec"]["template"]["spec"], _container(dep)
    _, engine = _server_args(dep)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    image_volumes = next(a for w, a in instructions() if w == "VOLUME")
    for path in yaml.safe_load(image_volumes):
        assert path in mounts, path
    assert mounts["/models"].get("readOnly") is True
    model = PurePosixPath(c["args"][1])
    assert model.is_relative_to("/models")
    cache = PurePosixPath(engine.compilation_cache_dir)
    (cache_mount,) = [m for p, m in mounts.items() if cache.is_relative_to(p)]
    assert not cache_mount.get("readOnly")
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
              if "persistentVolumeClaim" in v}
    pvcs = {d["metadata"]["name"] for d in base if d["kind"] == "PersistentVolumeClaim"}
    assert claims[cache_mount["name"]] in pvcs and claims[mounts["/models"]["name"]] in pvcs
    user = next(a for w, a in reversed(instructions()) if w == "USER").split(":")[0]
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and str(sc["runAsUser"]) == user
    assert str(sc["fsGroup"]) == user  # the cache volume is writable by that user
    (job,) = load_yaml(KUBERNETES / "prepare-model-job.yaml")
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert f"dst={model}" in script


def test_service_and_pdb_select_the_deployment_pods() -> None:
    base = _base()
    dep = _by_kind(base, "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc, pdb = _by_kind(base, "Service"), _by_kind(base, "PodDisruptionBudget")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in _container(dep)["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    namespaces = {d["metadata"]["namespace"] for d in base if d["kind"] != "Namespace"}
    assert namespaces == {_by_kind(base, "Namespace")["metadata"]["name"]}


# ---- autoscaling ---------------------------------------------------------------------------


def _keda() -> dict:
    (so,) = load_yaml(KEDA)
    return so


def _hpa() -> dict:
    (hpa,) = load_yaml(HPA)
    return hpa


@pytest.mark.parametrize("version", VERSIONS)
def test_keda_scaled_object_structure(version: str) -> None:
    """KEDA's CRD schema is not bundled anywhere we can install from, so the ScaledObject is
    checked by hand against keda.sh/v1alpha1's documented fields; its HPA behaviour block is
    the HPA's own type and is validated by the Kubernetes schema inside a synthetic HPA."""
    so = _keda()
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["kind"] == "ScaledObject"
    dep = _by_kind(_base(), "Deployment")
    assert so["metadata"]["namespace"] == dep["metadata"]["namespace"]
    served = build_parser().parse_args(_container(dep)["args"]).served_model_name
    spec = so["spec"]
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount",
                         "pollingInterval", "cooldownPeriod", "idleReplicaCount", "fallback",
                         "advanced", "triggers", "initialCooldownPeriod"}
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": dep["metadata"]["name"]}
    assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
    assert spec["fallback"]["replicas"] >= spec["minReplicaCount"]
    assert set(spec["advanced"]) <= {"horizontalPodAutoscalerConfig", "restoreToOriginalReplicaCount",
                                     "scalingModifiers"}
    hpa = copy.deepcopy(_hpa())
    hpa["spec"]["behavior"] = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    kv.validate(hpa, version, strict=True)
    for t in spec["triggers"]:
        assert t["type"] == "prometheus" and t["metricType"] == "AverageValue"  # per replica
        md = t["metadata"]
        assert set(md) <= {"serverAddress", "query", "threshold", "activationThreshold",
                           "ignoreNullValues", "namespace", "customHeaders", "unsafeSsl",
                           "queryParameters", "timeout"}
        assert md["serverAddress"].startswith("http")
        assert all(isinstance(v, str) for v in md.values())  # KEDA's metadata is strings
        assert float(md["threshold"]) > 0
        # the series of this Deployment: its namespace and its --served-model-name
        assert f'namespace="{so["metadata"]["namespace"]}"' in md["query"]
        assert f'model_name="{served}"' in md["query"]


def _up_fast_down_slow(behavior: dict) -> None:
    up, down = behavior["scaleUp"], behavior["scaleDown"]
    assert up["stabilizationWindowSeconds"] == 0 and up["selectPolicy"] == "Max"
    assert down["stabilizationWindowSeconds"] >= 300 and down["selectPolicy"] == "Min"
    assert max(p["periodSeconds"] for p in up["policies"]) <= 15  # one HPA sync
    (pods_down,) = [p for p in down["policies"] if p["type"] == "Pods"]
    pods_up = [p for p in up["policies"] if p["type"] == "Pods"]
    # pods per second: adding is faster than removing
    assert max(p["value"] / p["periodSeconds"] for p in pods_up) > (
        pods_down["value"] / pods_down["periodSeconds"])


def test_keda_and_hpa_scale_up_fast_down_slow_on_the_same_targets() -> None:
    so, hpa = _keda()["spec"], _hpa()["spec"]
    keda_behavior = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    _up_fast_down_slow(keda_behavior)
    _up_fast_down_slow(hpa["behavior"])
    assert keda_behavior == hpa["behavior"]
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == (hpa["minReplicas"],
                                                              hpa["maxReplicas"])
    keda_targets = sorted(float(t["metadata"]["threshold"]) for t in so["triggers"])
    hpa_targets = sorted(float(m["pods"]["target"]["averageValue"]) for m in hpa["metrics"])
    assert keda_targets == hpa_targets


def test_hpa_metrics_are_the_ones_prometheus_adapter_serves() -> None:
    (values,) = load_yaml(ADAPTER)
    served = {r["name"]["as"] for r in values["rules"]["custom"]}
    assert values["rules"]["default"] is False
    for r in values["rules"]["custom"]:
        assert r["resources"]["overrides"].keys() == {"namespace", "pod"}
    for m in _hpa()["spec"]["metrics"]:
        assert m["type"] == "Pods" and m["pods"]["target"]["type"] == "AverageValue"
        assert m["pods"]["metric"]["name"] in served



def test_kv_events_flags_parse_and_their_port_is_declared() -> None:
    """The deployment's --kv-events-config is a valid engine setting whose endpoint port is a
    declared container port, with hashes a router can recompute."""
    dep = _by_kind(_base(), "Deployment")
    container = _container(dep)
    flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"] if "=" in a)
    cfg = EngineConfig(kv_events_config=flags["kv-events-config"],
                       prefix_caching_hash_algo=flags["prefix-caching-hash-algo"])
    assert cfg.kv_events.publishing and cfg.prefix_caching_hash_algo == "sha256_cbor"
    port = int(cfg.kv_events.endpoint.rsplit(":", 1)[1])
    assert {"name": "kv-events", "containerPort": port, "protocol": "TCP"} in container["ports"]
    pod_ip = {e["name"]: e for e in container["env"]}["POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert cfg.kv_events.topic.startswith("kv@$(POD_IP)@")
