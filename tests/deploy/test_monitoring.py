"""Every Prometheus query under deploy/ (the Grafana dashboard, the rule file, the KEDA triggers,
the prometheus-adapter rules) parses, and names only series that the server's /metrics exports
(scraped from the app with the fake engine, which records into the real ``EngineMetrics``), that
the rule file records, or that Prometheus adds itself (``up``). With promtool (Debian's
prometheus package) present, the rule file passes ``promtool check rules`` and every other query
passes Prometheus's own parser; without it those two tests skip."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.queries import (
    DASHBOARD,
    PROMETHEUS_SERIES,
    RULES,
    all_queries,
    dashboard_queries,
    exported_sample_names,
    load_yaml,
    recorded_names,
    rule_queries,
)

promql = pytest.importorskip("promql_parser", reason="promql-parser is not installed (a test extra)")

QUERIES = all_queries()


def selector_names(expr: str) -> set[str]:
    """The metric names of every vector and range selector of a PromQL expression (raises
    ValueError when it does not parse)."""
    names: list[str | None] = []

    def visit(node: object, *_: object) -> bool:
        if isinstance(node, promql.VectorSelector):
            names.append(node.name)
        return True

    promql.walk(promql.parse(expr), visit)
    assert None not in names, f"a selector without a metric name in {expr!r}"
    return set(names)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_sample_names()


def test_the_scrape_is_the_full_exposition(exported: set[str]) -> None:
    # guards the test below against an empty or engine-less scrape
    for name in ("jaxserve:num_requests_waiting", "jaxserve:time_to_first_token_seconds_bucket",
                 "jaxserve:draining", "jaxserve:time_to_ready_seconds",
                 "process_start_time_seconds", "vllm:num_requests_waiting"):
        assert name in exported, name


@pytest.mark.parametrize("expr", [pytest.param(e, id=w) for w, e in QUERIES])
def test_query_parses_and_names_only_exported_series(expr: str, exported: set[str]) -> None:
    unknown = selector_names(expr) - exported - recorded_names() - PROMETHEUS_SERIES
    assert not unknown, f"{sorted(unknown)} are not exported by the server"


def test_recorded_names_follow_the_convention_and_the_dashboard_needs_none() -> None:
    recorded = recorded_names()
    for name in recorded:  # Prometheus' convention level:metric:operations
        assert name.count(":") == 2, name
    for where, expr in dashboard_queries():
        # the dashboard reads raw series, so it works without the rule file loaded
        assert not selector_names(expr) & recorded, where


def test_the_dashboard_shows_what_operators_read() -> None:
    dash = json.loads(DASHBOARD.read_text())
    names = set().union(*(selector_names(e) for _, e in dashboard_queries()))
    for needed in ("jaxserve:generation_tokens_total",
                   "jaxserve:time_to_first_token_seconds_bucket",
                   "jaxserve:inter_token_latency_seconds_bucket",
                   "jaxserve:num_requests_waiting", "jaxserve:num_requests_running",
                   "jaxserve:num_tokens_in_flight", "jaxserve:prefill_backlog_seconds",
                   "jaxserve:kv_cache_usage_perc", "jaxserve:batch_seqs_usage_perc",
                   "jaxserve:batch_tokens_usage_perc", "jaxserve:num_preemptions_total",
                   "jaxserve:draining", "jaxserve:time_to_ready_seconds",
                   "jaxserve:num_compiles_after_warmup_total"):
        assert needed in names, needed
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        for t in p["targets"]:
            for v in ("namespace", "model_name", "pod"):
                if f"${v}" in t["expr"]:
                    assert v in variables


def test_the_rules_alert_on_what_the_issue_names() -> None:
    (doc,) = load_yaml(RULES)
    alerts = {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}
    assert {"JaxserveQueueGrowing", "JaxserveTTFTOverSLO", "JaxserveKVCacheUsageHigh",
            "JaxserveCompilesAfterWarmup", "JaxserveTargetDown",
            "JaxserveNoReadyReplica"} <= alerts.keys()
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"], name


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus); the "
                    "queries were parsed with promql-parser only")
    return exe


def test_promtool_check_rules() -> None:
    out = subprocess.run([_promtool(), "check", "rules", str(RULES)], check=False,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_parses_every_other_query(tmp_path: Path) -> None:
    """Prometheus's own parser, through a rule file holding each query as a recording rule."""
    exe = _promtool()
    rules = [{"record": f"check:query_{i}:expr", "expr": e}
             for i, (_, e) in enumerate(q for q in QUERIES if q not in rule_queries())]
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    out = subprocess.run([exe, "check", "rules", str(path)], check=False,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
