"""``--forward-pass-metrics-port`` and ``--forward-pass-metrics-worker-id``: off by default, on
from the flags or from the variables Dynamo's vLLM worker reads, errors that name them."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.config_args import add_engine_args, engine_config_from_args
from jaxserve.engine.llm_engine import LLMEngine
from tests.conftest import REPO_ROOT


def parse(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    p.add_argument("--config")
    return engine_config_from_args(p.parse_args(list(argv)))


def test_off_unless_the_flag_or_dynamos_variable_is_set(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("DYN_FORWARDPASS_METRIC_PORT", raising=False)
    monkeypatch.delenv("DYN_FPM_WORKER_ID", raising=False)
    cfg = parse()
    assert (cfg.forward_pass_metrics_port, cfg.forward_pass_metrics_worker_id) == (None, "")
    cfg = parse("--forward-pass-metrics-port", "20380", "--forward-pass-metrics-worker-id", "w1")
    assert (cfg.forward_pass_metrics_port, cfg.forward_pass_metrics_worker_id) == (20380, "w1")
    monkeypatch.setenv("DYN_FORWARDPASS_METRIC_PORT", "21000")
    monkeypatch.setenv("DYN_FPM_WORKER_ID", "conn-42")
    cfg = parse()
    assert (cfg.forward_pass_metrics_port, cfg.forward_pass_metrics_worker_id) == (21000,
                                                                                     "conn-42")
    config_file = tmp_path / "c.yaml"
    config_file.write_text("forward-pass-metrics-port: 22000\n")
    assert parse("--config", str(config_file)).forward_pass_metrics_port == 22000  # file wins
    assert parse("--config", str(config_file), "--forward-pass-metrics-port", "23000"
                 ).forward_pass_metrics_port == 23000  # the flag wins


def test_bad_values_name_the_flag_or_variable(monkeypatch) -> None:
    monkeypatch.delenv("DYN_FORWARDPASS_METRIC_PORT", raising=False)
    with pytest.raises(ValueError, match=r"^--forward-pass-metrics-port=70000 must be a port"):
        parse("--forward-pass-metrics-port", "70000")
    monkeypatch.setenv("DYN_FORWARDPASS_METRIC_PORT", "twenty")
    with pytest.raises(ValueError, match=r"\$DYN_FORWARDPASS_METRIC_PORT='twenty' is not a "
                                         r"valid --forward-pass-metrics-port"):
        parse()


def test_the_engine_imports_no_zmq_until_the_metrics_are_on() -> None:
    code = ("import sys, jaxserve.fleet_metrics, jaxserve.engine.llm_engine\n"
            "print('zmq' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO_ROOT)
    assert out.stdout.strip() == "False"


def test_a_taken_port_fails_before_the_weights_load() -> None:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"forward_pass_metrics_port: cannot bind "
                                             f"tcp://\\*:{port}"):
            LLMEngine(EngineConfig(forward_pass_metrics_port=port),
                      LoadConfig(model="no-such-config", load_format="dummy"))
