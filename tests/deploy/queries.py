"""The deployment files (the Dockerfile, deploy/) and the Prometheus queries in them, for the
deploy tests.

Queries are collected from every place one lives (the Grafana dashboard's panels and template
variables, the rule file, the KEDA triggers, the prometheus-adapter rules) with Grafana's and the
adapter's template variables replaced by values, so each is plain PromQL that a parser takes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from jaxserve.server.routes import build_app
from jaxserve.server_config import ServerConfig
from tests.conftest import REPO_ROOT
from tests.support.fake_engine import FakeEngine

DOCKERFILE = REPO_ROOT / "Dockerfile"
DEPLOY = REPO_ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DASHBOARD = DEPLOY / "grafana" / "jaxserve-dashboard.json"
RULES = DEPLOY / "prometheus" / "rules.yaml"
KEDA = KUBERNETES / "autoscaling" / "keda-scaledobject.yaml"
HPA = KUBERNETES / "autoscaling" / "hpa.yaml"
ADAPTER = KUBERNETES / "autoscaling" / "prometheus-adapter-values.yaml"
# Series Prometheus itself adds to every target (not exported by the server).
PROMETHEUS_SERIES = frozenset({"up"})

# Grafana's variables: $__rate_interval and friends, then the dashboard's own ($namespace, ...)
_GRAFANA_INTERVAL = re.compile(r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|"
                               r"__interval|__range)\}")
_GRAFANA_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$", re.DOTALL)
_ADAPTER_VARS = {"<<.LabelMatchers>>": 'namespace="jaxserve",pod="jaxserve-0"',
                 "<<.GroupBy>>": "namespace, pod"}


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        word, _, args = (pending + line).partition(" ")
        out.append((word.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def load_yaml(path: Path) -> list[dict]:
    """Every YAML document of ``path`` (empty documents dropped)."""
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def grafana_to_promql(expr: str) -> str:
    """A panel or variable query with Grafana's variables replaced: intervals by 5m, the
    dashboard's variables by ``.*`` (they stand in regex matchers); ``label_values(Q, label)``
    becomes Q."""
    expr = _GRAFANA_INTERVAL.sub("5m", expr.strip())
    expr = _GRAFANA_VAR.sub(".*", expr)
    m = _LABEL_VALUES.match(expr)
    return m.group(1) if m else expr


def adapter_to_promql(query: str, series: str) -> str:
    """A prometheus-adapter ``metricsQuery`` with its template fields filled in."""
    for k, v in _ADAPTER_VARS.items():
        query = query.replace(k, v)
    return query.replace("<<.Series>>", series)


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable of the dashboard."""
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out.append((f"dashboard panel {panel['title']!r} {t['refId']}",
                        grafana_to_promql(t["expr"])))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"dashboard variable {var['name']!r}",
                        grafana_to_promql(var["query"]["query"])))
    return out


def rule_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every recording and alerting rule."""
    (doc,) = load_yaml(RULES)
    return [(f"rule {r.get('record') or r.get('alert')}", r["expr"])
            for g in doc["groups"] for r in g["rules"]]


def recorded_names() -> set[str]:
    """The series the rule file records."""
    (doc,) = load_yaml(RULES)
    return {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}


def autoscaler_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of the KEDA triggers and the prometheus-adapter rules."""
    (so,) = load_yaml(KEDA)
    out = [(f"KEDA trigger {t['name']}", t["metadata"]["query"]) for t in so["spec"]["triggers"]]
    (values,) = load_yaml(ADAPTER)
    for rule in values["rules"]["custom"]:
        series = rule["seriesQuery"].split("{", 1)[0].strip("'\"")
        out.append((f"adapter seriesQuery {rule['name']['as']}", rule["seriesQuery"]))
        out.append((f"adapter metricsQuery {rule['name']['as']}",
                    adapter_to_promql(rule["metricsQuery"], series)))
    return out


def all_queries() -> list[tuple[str, str]]:
    """Every Prometheus query under deploy/."""
    return dashboard_queries() + rule_queries() + autoscaler_queries()


def exported_sample_names() -> set[str]:
    """The sample names a running server's /metrics carries (with --metrics-compat vllm): the
    server's own series and the engine's, scraped from the app over its ASGI interface with the
    fake engine, which records into the real ``EngineMetrics``."""
    app = build_app(FakeEngine(), "fake-model", ServerConfig(metrics_compat="vllm"))
    text = TestClient(app).get("/metrics").text
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}
