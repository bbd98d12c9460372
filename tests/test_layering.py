"""The package layering: imports run one way along the request path.

``cli -> server -> engine -> {core, device, loading} -> {models, cpu_kernels, pallas_kernels}``,
with ``models -> pallas_kernels`` and ``cpu_kernels -> pallas_kernels`` (the native CPU kernels
build on the Pallas package's jnp op and KV-cache layout, never the reverse; the models know no
native kernel), the shared vocabulary (the modules at the top of ``jaxserve/``) depending on none
of the stages, and the platform layer (``jaxserve/platform/``, the only code that asks which
backend runs) above the kernels and the models, which it joins (its CPU weights implement the
models' ``KernelWeight`` over ``cpu_kernels``): the engine, ``LLM`` and the command ask it. The
tools the command dispatches to (``bench``, ``eval``, ``autoscaling``) sit beside ``cli``: it
imports them, they import the stages below it but not the server, and nothing below imports
them. Every import counts, including those inside functions and under ``TYPE_CHECKING``
(docs/architecture.md#imports-run-one-way).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxserve", "models", "cpu_kernels", "pallas_kernels")

# what each layer may import (besides itself); a layer is a subpackage of jaxserve, a top-level
# module of jaxserve ("vocabulary" unless named here), or one of the other top-level packages
ALLOWED: dict[str, set[str]] = {
    "pallas_kernels": set(),
    "cpu_kernels": {"pallas_kernels"},
    "models": {"pallas_kernels"},
    "vocabulary": {"models", "cpu_kernels", "pallas_kernels"},
    "core": {"vocabulary"},
    # KV-cache events: vLLM's wire structs over the KV manager's records, and the publisher
    "kv_events": {"vocabulary", "core"},
    # per-step records for fleet planners (Dynamo's ForwardPassMetrics) and their publisher
    "fleet_metrics": {"vocabulary", "core"},
    "platform": {"vocabulary", "models", "cpu_kernels", "pallas_kernels"},
    "device": {"vocabulary", "models", "cpu_kernels", "pallas_kernels"},
    "loading": {"vocabulary", "models", "cpu_kernels", "pallas_kernels"},
    "engine": {"vocabulary", "core", "device", "loading", "platform", "models", "cpu_kernels",
               "pallas_kernels", "kv_events", "fleet_metrics"},
    "server": {"vocabulary", "engine"},
    "llm": {"vocabulary", "engine", "platform"},
    "cli": {"vocabulary", "core", "device", "loading", "platform", "engine", "server", "llm",
            "models", "cpu_kernels", "pallas_kernels", "bench", "eval", "autoscaling"},
    # the tools beside the command: what cli may import but the server and cli itself
    "bench": {"vocabulary", "core", "device", "loading", "platform", "engine", "llm", "models",
              "cpu_kernels", "pallas_kernels"},
    "eval": {"vocabulary", "core", "device", "loading", "platform", "engine", "llm", "models",
             "cpu_kernels", "pallas_kernels"},
    "autoscaling": {"vocabulary", "bench"},  # bench's arrival times and metric parsing
    "init": set(),  # jaxserve/__init__.py names its exports as strings, imports none
}
ENTRY_MODULES = {"jaxserve.llm": "llm", "jaxserve": "init"}
NO_JAX_LAYERS = ("core", "autoscaling", "kv_events", "fleet_metrics")
JAX_MODULES = ("jax", "jaxlib", "flax", "orbax")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    if module in ENTRY_MODULES:
        return ENTRY_MODULES[module]
    top, *rest = module.split(".")
    if top != "jaxserve":
        return top
    if len(rest) >= 2 or (rest and (REPO_ROOT / "jaxserve" / rest[0]).is_dir()):
        return rest[0]
    return "vocabulary"


def imports_of(path: Path, module: str) -> set[str]:
    """Absolute names of every module ``path`` imports (from-imports resolved to submodules)."""
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            out.add(base)
            for a in node.names:  # `from jaxserve.core import scheduler` imports a module
                sub = f"{base}.{a.name}"
                if sub.replace(".", "/") and _exists(sub):
                    out.add(sub)
    return out


def _exists(module: str) -> bool:
    p = REPO_ROOT.joinpath(*module.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((REPO_ROOT / pkg).rglob("*.py")):
            mod = module_name(path)
            graph[mod] = imports_of(path, mod)
    return graph


def internal(graph: dict[str, set[str]], name: str) -> str | None:
    """The module of ours that an imported name refers to (a package or a module), else None."""
    while name:
        if name in graph:
            return name
        name = name.rpartition(".")[0]
    return None


def test_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    edges = {m: {t for n in names if (t := internal(graph, n)) and t != m}
             for m, names in graph.items()}
    # a package's __init__ is not an edge target that runs its siblings, so drop p -> p.x
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_each_layer_imports_only_layers_below() -> None:
    graph = import_graph()
    bad = []
    for mod, names in sorted(graph.items()):
        src = layer_of(mod)
        for name in sorted(names):
            target = internal(graph, name)
            if target is None or target == "jaxserve" and name == "jaxserve":
                continue
            dst = layer_of(target)
            if dst != src and dst not in ALLOWED[src]:
                bad.append(f"{mod} ({src}) imports {target} ({dst})")
    assert not bad, "\n".join(bad)


def test_core_imports_no_jax() -> None:
    graph = import_graph()
    bad = [f"{mod} imports {name}" for mod, names in sorted(graph.items())
           if layer_of(mod) in NO_JAX_LAYERS
           for name in sorted(names) if name.split(".")[0] in JAX_MODULES]
    assert not bad, "\n".join(bad)


def test_layering_check_catches_a_bad_import(tmp_path: Path) -> None:
    """The checker itself: a core module importing the engine is reported."""
    mod = "jaxserve.core.example"
    names = imports_of(_write(tmp_path, "from jaxserve.engine import llm_engine\nimport jax\n"), mod)
    assert "jaxserve.engine.llm_engine" in names and "jax" in names
    assert layer_of(mod) == "core" and layer_of("jaxserve.engine.llm_engine") == "engine"
    assert "engine" not in ALLOWED["core"]
    assert "cpu_kernels" not in ALLOWED["pallas_kernels"] and layer_of("cpu_kernels.build") == \
        "cpu_kernels"
    assert "cpu_kernels" not in ALLOWED["models"] and "models" not in ALLOWED["cpu_kernels"]
    assert layer_of("jaxserve.config") == "vocabulary" and layer_of("jaxserve.llm") == "llm"
    assert layer_of("jaxserve.bench.serve") == "bench" and layer_of("jaxserve.eval.quality") == "eval"
    assert not any(tool in ALLOWED[layer] for tool in ("bench", "eval", "autoscaling")
                   for layer in ("server", "engine", "llm", "vocabulary"))


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "example.py"
    p.write_text(text)
    return p


# The one module that reads the CPU's flags: the kernels' build needs them without the platform
# layer (`jaxserve build-kernels` imports only cpu_kernels), and the platform asks it.
CPUINFO_READER = "cpu_kernels/build.py"


def _names_cpuinfo(path: Path) -> bool:
    return any(isinstance(node, ast.Constant) and node.value == "/proc/cpuinfo"
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))


def test_one_module_reads_proc_cpuinfo() -> None:
    readers = [str(path.relative_to(REPO_ROOT)) for pkg in PACKAGES
               for path in sorted((REPO_ROOT / pkg).rglob("*.py")) if _names_cpuinfo(path)]
    assert readers == [CPUINFO_READER]


def test_the_cpuinfo_check_finds_a_reader(tmp_path: Path) -> None:
    assert _names_cpuinfo(_write(tmp_path, 'open("/proc/cpuinfo").read()\n'))
    assert not _names_cpuinfo(_write(tmp_path, '"""Flags from /proc/cpuinfo."""\n'))


# What asks which backend runs: only jaxserve/platform/ may (the engine asks the platform).
BACKEND_QUESTIONS = ("default_backend(", "cpu_flags(", "cpu_has_bf16_dot")


def test_only_the_platform_layer_asks_which_backend_runs() -> None:
    bad = []
    for path in sorted((REPO_ROOT / "jaxserve").rglob("*.py")):
        if (REPO_ROOT / "jaxserve" / "platform") in path.parents:
            continue
        text = path.read_text(encoding="utf-8")
        bad += [f"{path.relative_to(REPO_ROOT)}: {q}" for q in BACKEND_QUESTIONS if q in text]
    assert not bad, "\n".join(bad)


# -- the tools on top: benchmarks/ and scripts/ use the public API only -------------------------
# What they may import of ours: the API the README and docs/ name for users and tools, the
# ``jaxserve bench`` commands' modules, and the kernels with their references (kernel harnesses
# time them). Nothing else of ``jaxserve``'s insides.
PUBLIC_MODULES = ("jaxserve", "jaxserve.config", "jaxserve.sampling_params", "jaxserve.outputs",
                  "jaxserve.engine.llm_engine", "jaxserve.engine.step_report",
                  "jaxserve.tokenizer", "jaxserve.loading.model_files", "jaxserve.eval.inputs",
                  # a model's files without an engine (docs/models.md): load_model, the
                  # convert command's function, the GGUF reader
                  "jaxserve.loading.load", "jaxserve.cli.convert", "models.gguf_reader",
                  "models.config")
PUBLIC_PACKAGES = ("jaxserve.bench", "pallas_kernels", "cpu_kernels")  # every module in them
# the GPU machine's check runs where the server's packages (msgspec, starlette, tokenizers,
# llguidance) are not installed, so it builds the model runner itself, below the engine
DEVICE_HARNESSES = {"scripts/gpu_check.py": (
    "jaxserve.device.buckets", "jaxserve.device.runner", "jaxserve.device.step_buffer",
    "jaxserve.platform", "jaxserve.platform.base", "jaxserve.platform.gpu", "models.llama",
    "models.loader")}
# an engine's parts: a harness asks the engine (its public methods), never reaches into them
ENGINE_PARTS = ("scheduler", "runner", "packer", "dispatcher", "reporter", "grammars", "slots")
TOOL_DIRS = ("benchmarks", "scripts")


def _public(module: str, extra: tuple[str, ...] = ()) -> bool:
    return module in PUBLIC_MODULES or module in extra or any(
        module == p or module.startswith(p + ".") for p in PUBLIC_PACKAGES)


def private_names() -> set[str]:
    """The private names our packages define: functions, classes and module globals starting
    with ``_``, and ``self._x`` attributes (a harness may use a library's privates, not ours)."""
    out: set[str] = set()
    for pkg in PACKAGES:
        for path in (REPO_ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    out.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    out.add(node.id)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def tool_violations(path: Path, graph: dict[str, set[str]],
                    private: set[str] | None = None) -> list[str]:
    """What a harness does past the public API: imports of other modules of ours, private
    names imported, attributes of an engine's parts or our private attributes of an object."""
    private = private_names() if private is None else private
    rel = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.name
    extra = DEVICE_HARNESSES.get(rel, ())
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bad = [f"{rel} imports {target}" for name in sorted(imports_of(path, "tool"))
           if (target := internal(graph, name)) is not None and not _public(target, extra)]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
            bad += [f"{rel}:{node.lineno} imports private {a.name}" for a in node.names
                    if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if node.attr in ENGINE_PARTS or (
                    node.attr in private and owner not in ("self", "cls")):
                bad.append(f"{rel}:{node.lineno} reads .{node.attr}")
    return bad


def test_benchmarks_and_scripts_use_the_public_api_only() -> None:
    graph, private = import_graph(), private_names()
    bad = [v for d in TOOL_DIRS for path in sorted((REPO_ROOT / d).rglob("*.py"))
           for v in tool_violations(path, graph, private)]
    assert not bad, "\n".join(bad)


def test_public_api_check_catches_a_harness_reaching_inside(tmp_path: Path) -> None:
    graph = import_graph()
    p = _write(tmp_path, "from jaxserve.core.scheduler import Scheduler\n"
                         "from jaxserve import LLM\nllm = LLM()\n"
                         "n = llm.engine.scheduler.num_preemptions_total\nx = llm.engine._inflight\n"
                         "y = some_library._own_private\n")
    bad = tool_violations(p, graph)
    assert any("imports jaxserve.core.scheduler" in b for b in bad)
    assert "_inflight" in private_names()  # LLMEngine's step in flight
    assert any("reads .scheduler" in b for b in bad) and any("reads ._inflight" in b for b in bad)
    assert not any("_own_private" in b for b in bad)  # not ours
    assert not any("jaxserve\n" in b or b.endswith("imports jaxserve") for b in bad)


MAX_MODULE_LINES = 450  # a module past it holds more than one concept: split it by concept


def test_no_module_of_jaxserve_passes_450_lines() -> None:
    long = [f"{p.relative_to(REPO_ROOT)}: {n} lines"
            for p in sorted((REPO_ROOT / "jaxserve").rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert not long, "\n".join(long)
