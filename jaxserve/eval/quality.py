"""``jaxserve eval``: quality and memory of a model configuration against the unquantised model.

Data flow:
  read the corpus text and the prompt file (fail fast on bad input) -> build the baseline engine
  (the model as loaded: no weight or KV-cache quantisation) -> tokenise -> score the corpus in
  overlapping windows, all submitted at once so the engine batches them, each asking for
  ``prompt_logprobs=1`` (per prompt token: the target's logprob and the argmax) -> greedy
  continuations of the prompt set (timed) -> free the engine -> the same on a fresh engine for
  every ``--compare`` configuration -> one row per configuration against the baseline.

Everything runs through ``LLMEngine`` (the paged path), so a quantised KV cache is read by
attention exactly as when serving; the windows and the scoring are ``jaxserve.eval.scoring``'s.

Metrics (each configuration; the baseline has the same keys):
  ppl: ``exp(-mean log p(token | context))`` over the scored tokens.
  delta_ppl_pct: ``100 * (ppl - baseline ppl) / baseline ppl``.
  top1_agreement: fraction of scored positions whose argmax equals the baseline's.
  greedy_agreement: fraction of prompts whose greedy tokens (the first ``greedy_tokens``, or
    fewer when EOS comes first; the EOS token included) equal the baseline's exactly.
  output_tok_s: generated tokens / wall seconds of the greedy phase (prefill included;
    host- and load-dependent).
  weights_gib: bytes of the params pytree (sum of leaf ``nbytes``; quantised leaves with their
    scales) / 2**30.
  kv_bytes_per_token: bytes of all KV-cache leaves / (num_blocks * block_size).
  max_concurrent_seqs: sequences of ``max_model_len`` tokens whose KV cache fits in the memory
    the baseline uses for weights plus KV cache:
    ``floor((baseline weights + baseline KV bytes - weights bytes) / (kv_bytes_per_token *
    max_model_len))`` (0 when that is negative).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from jaxserve.config import KV_8BIT_DTYPES, EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.eval.inputs import (
    DEFAULT_CORPUS,
    DEFAULT_PROMPTS,
    NO_CHANGE,
    UNQUANTISED,
    baseline_config,
    config_fields,
    describe,
    parse_compare,
    prompt_token_ids,
    read_corpus,
    read_prompts,
)
from jaxserve.eval.scoring import CorpusScores, greedy_tokens, memory_bytes, score_corpus
from jaxserve.platform import current_platform
from models import checkpoint
from models.quant import QuantConfig, quantized_shapes
from models.quant_formats import DEFAULT_GROUP_SIZE
from models.registry import get_architecture

GIB = 1 << 30
ROW_KEYS = ("config", "weights_gib", "kv_bytes_per_token", "max_concurrent_seqs", "ppl",
            "delta_ppl_pct", "top1_agreement", "greedy_agreement", "output_tok_s")


# -- configurations -------------------------------------------------------------------------------

@dataclass
class ConfigResult:
    """What one configuration's engine produced (kept for the baseline to compare against)."""

    name: str
    weights_bytes: int
    kv_bytes: int
    kv_bytes_per_token: float
    max_model_len: int
    corpus: CorpusScores | None
    greedy: list[list[int]] | None
    greedy_wall_s: float


@dataclass(frozen=True)
class EvalInputs:
    """What every configuration is run over.

    Fields:
      text: the corpus text, or None (no perplexity / top-1 columns).
      prompts: ``read_prompts`` objects, or None (no greedy / throughput columns).
      window, stride: scoring windows in tokens (None: ``min(512, max_model_len - 1)`` and
        half the window).
      max_eval_tokens: score only the corpus's first tokens (None: all).
      greedy_tokens: tokens generated per prompt (at most).
    """

    text: str | None
    prompts: list[dict] | None
    window: int | None = None
    stride: int | None = None
    max_eval_tokens: int | None = None
    greedy_tokens: int = 32

    def __post_init__(self) -> None:
        if self.text is None and self.prompts is None:
            raise ValueError("nothing to evaluate: give --text and/or --prompts")
        if self.max_eval_tokens is not None and self.max_eval_tokens < 2:
            raise ValueError(f"--max-eval-tokens must be >= 2, got {self.max_eval_tokens}")
        if self.greedy_tokens < 1:
            raise ValueError(f"--greedy-tokens must be >= 1, got {self.greedy_tokens}")
        if self.window is not None and self.window < 2:
            raise ValueError(f"--eval-window must be >= 2, got {self.window}")
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"--eval-stride must be >= 1, got {self.stride}")


def run_config(name: str, config: EngineConfig, load: LoadConfig, inputs: EvalInputs, *,
               progress: bool = False, log: TextIO | None = None,
               check: Callable[[LLMEngine], None] | None = None) -> ConfigResult:
    """Build a fresh engine for ``config``, score the corpus and generate for the prompts, then
    drop the engine (and collect garbage) so the next configuration starts from free memory.
    ``check(engine)``, when given, runs once the engine is built, before any work.

    Raises:
      ValueError: invalid settings, a window longer than ``max_model_len - 1``, a corpus of
        fewer than 2 tokens, a request the engine refuses, or what ``check`` raises.
    """
    t0 = time.perf_counter()
    engine = LLMEngine(config, load)
    try:
        if check is not None:
            check(engine)
        stats = engine.warmup(progress=progress)
        if log is not None:
            print(f"[{name}] loaded and compiled {int(stats['num_programs'])} programs in "
                  f"{time.perf_counter() - t0:.1f} s ({engine.num_blocks} KV blocks)", file=log,
                  flush=True)
        weights, kv, per_token = memory_bytes(engine)
        corpus = None
        if inputs.text is not None:
            ids = engine.tokenizer.encode(inputs.text, add_special_tokens=False)
            ids = ids[:inputs.max_eval_tokens] if inputs.max_eval_tokens else ids
            window = inputs.window or min(512, engine.max_model_len - 1)
            if window > engine.max_model_len - 1:
                raise ValueError(f"--eval-window {window} must be below max_model_len "
                                 f"{engine.max_model_len} (each window also samples a token)")
            stride = inputs.stride or max(1, window // 2)
            corpus = score_corpus(engine, ids, window, stride, progress=progress,
                                  desc=f"{name}: perplexity")
        greedy, wall_s = None, 0.0
        if inputs.prompts is not None:
            greedy, wall_s = greedy_tokens(
                engine, prompt_token_ids(inputs.prompts, engine.tokenizer),
                inputs.greedy_tokens, progress=progress, desc=f"{name}: greedy")
        return ConfigResult(name, weights, kv, per_token, engine.max_model_len, corpus, greedy,
                            wall_s)
    finally:
        del engine
        gc.collect()


def metrics_row(result: ConfigResult, base: ConfigResult) -> dict:
    """One row of the report (keys ``ROW_KEYS``): ``result`` against the baseline ``base``;
    metrics whose input was not given are None."""
    budget = base.weights_bytes + base.kv_bytes - result.weights_bytes
    row: dict[str, object] = {
        "config": result.name,
        "weights_gib": result.weights_bytes / GIB,
        "kv_bytes_per_token": result.kv_bytes_per_token,
        "max_concurrent_seqs": max(0, math.floor(
            budget / (result.kv_bytes_per_token * result.max_model_len))),
        "ppl": None, "delta_ppl_pct": None, "top1_agreement": None,
        "greedy_agreement": None, "output_tok_s": None,
    }
    if result.corpus is not None and base.corpus is not None:
        ppl, base_ppl = result.corpus.ppl, base.corpus.ppl
        row["ppl"] = ppl
        row["delta_ppl_pct"] = 100.0 * (ppl - base_ppl) / base_ppl
        row["top1_agreement"] = float((result.corpus.argmax == base.corpus.argmax).mean())
    if result.greedy is not None and base.greedy is not None:
        same = sum(a == b for a, b in zip(result.greedy, base.greedy, strict=True))
        row["greedy_agreement"] = same / len(base.greedy)
        num_tokens = sum(len(t) for t in result.greedy)
        row["output_tok_s"] = num_tokens / result.greedy_wall_s if result.greedy_wall_s else None
    return row


def _refuse_quantised_checkpoint(load: LoadConfig) -> None:
    """The baseline is the model unquantised, which a checkpoint written by ``jaxserve convert
    --quantization`` cannot give (its float weights are gone).

    Raises:
      ValueError: ``load.model`` is such a checkpoint (naming its quantisation).
    """
    path = load.model or ""
    if not (os.path.isdir(path) and checkpoint.is_checkpoint(path)):
        return
    have = checkpoint.read_quantization(path)
    if have.method != "none":
        raise ValueError(f"--model {path} holds weights quantised as {have.describe()}; jaxserve "
                         f"eval compares against the model unquantised, so give it the model "
                         f"that checkpoint was converted from")


def check_quantization(engine: LLMEngine, configs: Sequence[tuple[str, EngineConfig]]
                       ) -> None:
    """Refuse, before the baseline's long run, a compared weight quantisation that the loaded
    model cannot take: an architecture without quantisation support, or an int4 group size
    that does not divide its weights (shape arithmetic on the model's params, nothing run).

    Raises:
      ValueError: naming the configuration and the cause.
    """
    arch = get_architecture(engine.model_config.architecture)
    for name, cfg in configs:
        if cfg.quantization == "none":
            continue
        try:
            if arch.quant_targets is None:
                raise ValueError(f"architecture {arch.name!r} does not support weight "
                                 f"quantisation")
            quantized_shapes(engine.model.param_shapes(), arch.quant_targets,
                             QuantConfig(cfg.quantization, cfg.quantization_group_size,
                                         cfg.quantize_embeddings))
        except ValueError as e:
            raise ValueError(f"configuration {name!r}: {e}") from None


def evaluate(config: EngineConfig, load: LoadConfig, inputs: EvalInputs,
             configs: Sequence[tuple[str, dict[str, object]]], *, progress: bool = False,
             log: TextIO | None = None, on_row: Callable[[dict], None] | None = None) -> dict:
    """The report: the baseline (``baseline_config(config)``) first, then each ``(name,
    overrides)`` as ``dataclasses.replace(config, **overrides)`` on its own fresh engine.
    ``on_row(report so far)`` is called after each configuration (a long run that is stopped
    keeps what it finished).

    Returns ``{"baseline": row, "rows": [row, ...]}`` with rows as ``metrics_row``.
    Raises:
      ValueError: as ``run_config``, overrides that are not EngineConfig fields, or (once the
        baseline's engine is built, before it runs) as ``check_quantization``.
    """
    _refuse_quantised_checkpoint(load)
    fields = config_fields()
    built = []
    for name, overrides in configs:
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"configuration {name!r}: unsupported, EngineConfig has no "
                             f"field(s) {unknown}")
        built.append((name, dataclasses.replace(config, **overrides)))
    base = run_config("baseline", baseline_config(config), load, inputs, progress=progress,
                      log=log, check=lambda engine: check_quantization(engine, built))
    report: dict = {"baseline": metrics_row(base, base), "rows": []}
    if on_row is not None:
        on_row(report)
    for name, cfg in built:
        report["rows"].append(metrics_row(run_config(name, cfg, load, inputs, progress=progress,
                                                     log=log), base))
        if on_row is not None:
            on_row(report)
    return report


def format_table(report: dict) -> str:
    """The report as a text table, the baseline first."""
    cols = [("config", "config", "{}"), ("weights_gib", "weights GiB", "{:.4f}"),
            ("kv_bytes_per_token", "KV B/tok", "{:.0f}"),
            ("max_concurrent_seqs", "max seqs", "{}"), ("ppl", "ppl", "{:.4f}"),
            ("delta_ppl_pct", "Δppl %", "{:+.3f}"), ("top1_agreement", "top-1 agr", "{:.4f}"),
            ("greedy_agreement", "greedy agr", "{:.3f}"), ("output_tok_s", "out tok/s", "{:.1f}")]
    cells = [[h for _, h, _ in cols]]
    for row in [report["baseline"], *report["rows"]]:
        cells.append(["-" if row[k] is None else f.format(row[k]) for k, _, f in cols])
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- command line -----------------------------------------------------------------------------

def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The eval-specific flags (the engine and model flags are added by the caller)."""
    p.add_argument("--text", default=None,
                   help="UTF-8 corpus for perplexity and top-1 agreement (default, when neither "
                        "--text nor --prompts is given: the shipped set)")
    p.add_argument("--prompts", default=None,
                   help="JSONL prompt set for greedy agreement and output tok/s: one "
                        "{\"prompt\": str} or {\"messages\": [...]} per line")
    p.add_argument("--compare", default=None,
                   help="configurations to compare with the unquantised baseline, comma "
                        "separated; parts joined with '+': int8, int4, fp8 (weights), emb "
                        "(also the embedding / LM head), bfloat16, float32 (--dtype), "
                        "kv-fp8, kv-int8, kv-bfloat16 (KV cache), none (e.g. "
                        "int8,int4,fp8,kv-fp8,kv-int8,int8+emb+kv-fp8). Default: the "
                        "configuration the engine flags give, when it is quantised")
    p.add_argument("--output", default=None, help="also write the report as JSON here")
    p.add_argument("--eval-window", type=int, default=None,
                   help="tokens per scoring window (default: min(512, max_model_len - 1))")
    p.add_argument("--eval-stride", type=int, default=None,
                   help="new tokens scored per window; the rest is context (default: half the "
                        "window)")
    p.add_argument("--max-eval-tokens", type=int, default=None,
                   help="score only the corpus's first N tokens")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--greedy-tokens", type=int, default=32,
                   help="tokens generated (greedy) per prompt")


def row_names(config: EngineConfig, configs: Sequence[tuple[str, dict[str, object]]]
              ) -> list[tuple[str, dict[str, object]]]:
    """Name each ``(item, overrides)`` by what it runs on top of ``config``: ``describe()`` of
    the resulting config (so quantisation flags given beside ``--compare`` show, e.g.
    ``int8+kv-fp8``), with ``@gN`` for int4 at a group size other than the default and the
    ``--dtype`` first when the item changes it (``bfloat16``, ``bfloat16+int8``).

    Raises:
      ValueError: two items that run the same configuration (e.g. ``int8+emb,emb+int8``), or
        an override EngineConfig refuses.
    """
    out: list[tuple[str, dict[str, object]]] = []
    seen: dict[str, str] = {}
    for item, overrides in configs:
        cfg = dataclasses.replace(config, **overrides)
        name = describe(cfg)
        if cfg.quantization == "int4" and cfg.quantization_group_size != DEFAULT_GROUP_SIZE:
            name += f"@g{cfg.quantization_group_size}"
        dtype = current_platform().resolve_dtype(cfg.dtype)
        if dtype != current_platform().resolve_dtype(config.dtype):  # the float dtype, when the item changes it
            name = dtype.name if name == "none" else f"{dtype.name}+{name}"
        if name in seen:
            raise ValueError(f"--compare: {seen[name]!r} and {item!r} run the same "
                             f"configuration ({name})")
        seen[name] = item
        out.append((name, overrides))
    return out


def run(ns: argparse.Namespace, config: EngineConfig, load: LoadConfig,
        kv_calibration_file: str | None = None) -> int:
    """``jaxserve eval``: check the inputs, evaluate, print the table; returns the exit status.

    The table goes to stdout; the progress, and the table so far after each configuration, to
    stderr; ``--output`` is rewritten after each configuration.

    Args:
      ns: the parsed ``eval`` flags.
      config: the configuration the engine flags give; the compared ones are built on it.
      load: the model.
      kv_calibration_file: given to every compared configuration with an 8-bit KV cache (the
        baseline's cache is float, so it gets none).
    Raises:
      ValueError: naming the flag.
    """
    if ns.num_prompts is not None and ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    text_path, prompts_path = ns.text, ns.prompts
    if text_path is None and prompts_path is None:
        text_path, prompts_path = DEFAULT_CORPUS, DEFAULT_PROMPTS
    text = read_corpus(text_path) if text_path is not None else None
    prompts = read_prompts(prompts_path) if prompts_path is not None else None
    if prompts is not None and ns.num_prompts is not None:
        prompts = prompts[:ns.num_prompts]
    inputs = EvalInputs(text, prompts, ns.eval_window, ns.eval_stride, ns.max_eval_tokens,
                        ns.greedy_tokens)
    if ns.compare is not None:
        unquantised = {k: v for k, v in UNQUANTISED.items() if k in config_fields()}
        configs = [(name, dict(unquantised) if name in NO_CHANGE else overrides)
                   for name, overrides in parse_compare(ns.compare)]
        if kv_calibration_file is not None:
            for _, overrides in configs:
                if overrides.get("kv_cache_dtype", config.kv_cache_dtype) in KV_8BIT_DTYPES:
                    overrides["kv_calibration_file"] = kv_calibration_file
    elif describe(config) != "none":
        configs = [(describe(config), {})]
    else:
        configs = []
    configs = row_names(config, configs)
    if ns.output:  # checked before the long run; an empty file is not left behind
        existed = os.path.exists(ns.output)
        try:
            open(ns.output, "a").close()
            if not existed:
                os.remove(ns.output)
        except OSError as e:
            raise ValueError(f"--output {ns.output}: cannot write it: {e.strerror or e}"
                             ) from None

    def save(report: dict) -> None:  # after every configuration: the table so far
        print(format_table(report), file=sys.stderr, flush=True)
        if ns.output:
            with open(ns.output, "w", encoding="utf-8") as fh:
                json.dump(report, fh, indent=2)
                fh.write("\n")

    report = evaluate(config, load, inputs, configs, progress=True, log=sys.stderr, on_row=save)
    print(format_table(report), flush=True)
    return 0
