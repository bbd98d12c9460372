"""A peer's released wheel from PyPI, to run its own files unmodified in the tests.

``download`` fetches a wheel once (``pip download --no-deps``, kept in ``$JAXSERVE_TEST_CACHE``
or ``~/.cache/jaxserve-tests/wheels``) and checks its sha256 against the one PyPI publishes;
``Wheel.source`` reads a file of it, checked against the wheel's RECORD; ``exec_module`` runs
such a file as a module. A test is skipped when PyPI cannot be reached (CI reaches it).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

DOWNLOAD_TIMEOUT_S = 300


def cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_TEST_CACHE", Path.home() / ".cache" / "jaxserve-tests"))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(requirement: str, filename: str, digest: str, pip_args: tuple[str, ...] = ()
             ) -> Path:
    """The wheel ``filename`` of ``requirement`` (``"name==version"``), downloaded once and
    checked against PyPI's sha256 ``digest``; skips the test when it cannot be downloaded.

    Raises:
      AssertionError: the file's sha256 differs from ``digest``.
    """
    dest = cache_dir() / "wheels"
    path = dest / filename
    if not (path.exists() and sha256(path) == digest):
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               *pip_args, "--dest", str(dest), requirement]
        try:
            r = subprocess.run(cmd, check=False, capture_output=True, text=True,
                               timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"{requirement} did not download in {DOWNLOAD_TIMEOUT_S} s")
        if r.returncode != 0 or not path.exists():
            pytest.skip(f"{requirement} could not be downloaded from the package index: "
                        f"{r.stderr.strip()[-300:]}")
    if sha256(path) != digest:
        raise AssertionError(f"{path} is not PyPI's {filename} (sha256 differs)")
    return path


class Wheel:
    """Reads files of a wheel, each checked against its RECORD line."""

    def __init__(self, path: Path) -> None:
        self.zip = zipfile.ZipFile(path)
        record = next(n for n in self.zip.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(io.StringIO(self.zip.read(record).decode()))
        self.record = {r[0]: r[1] for r in rows if len(r) > 1 and r[1]}

    def source(self, name: str) -> str:
        data = self.zip.read(name)
        algo, _, digest = self.record[name].partition("=")
        got = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
        if got != digest:
            raise AssertionError(f"{name} differs from the wheel's RECORD")
        return data.decode()


def exec_module(name: str, text: str, filename: str) -> types.ModuleType:
    """Run ``text`` as module ``name`` (registered in ``sys.modules``: msgspec and dataclasses
    look the module up while it runs; the caller removes it when it must not stay)."""
    m = types.ModuleType(name)
    m.__file__ = filename
    sys.modules[name] = m
    exec(compile(text, filename, "exec"), m.__dict__)  # noqa: S102 (the peer's own file)
    return m
