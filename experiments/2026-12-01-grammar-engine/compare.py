"""Which grammar engine constrains decoding: llguidance or outlines-core (xgrammar needs torch).

For each of the 20 schemas in jaxserve/data/json_schemas.jsonl, on SmolLM2's tokenizer (49152
ids): the time from schema to a matcher ready for its first mask (compile), then, walking the
tokens of the schema's example instance, the time to compute each step's allowed-token bitmask
(``i32[ceil(V / 32)]``) and to advance by the token. ``--stress`` times the compile alone of
three harder schemas (a 1000-character string, 40 properties, any JSON object), each in its own
process under a 30 s limit. Prints one table; ``--json PATH`` writes the rows.

    pip install --no-deps --target /tmp/gpkgs llguidance outlines-core
    PYTHONPATH=.:/tmp/gpkgs python experiments/2026-12-01-grammar-engine/compare.py [--stress]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from jaxserve.engine.structured_output import DEFAULT_WHITESPACE, _Vocabulary
from jaxserve.loading.model_files import default_gguf_path
from jaxserve.tokenizer import Tokenizer

SCHEMAS = "jaxserve/data/json_schemas.jsonl"
TIMEOUT_S = 30.0
STRESS = {
    "string_max_1000": {"type": "object", "properties": {"text": {"type": "string",
                        "maxLength": 1000}}, "required": ["text"]},
    "wide_40_props": {"type": "object", "properties": {
        f"field_{i}": {"type": "string", "maxLength": 32} for i in range(40)},
        "required": [f"field_{i}" for i in range(40)]},
    "any_json_object": {"type": "object"},
}


def _allowed(mask: np.ndarray, t: int) -> bool:
    return bool((mask.view(np.uint32)[t >> 5] >> (t & 31)) & 1)


def _llg_tokenizer(tok: Tokenizer):
    import llguidance
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tok)),
                                  n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids))


def _outlines_vocabulary(tok: Tokenizer):
    import outlines_core as oc
    table: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        if i not in tok.all_special_ids:
            table.setdefault(tok.token_bytes(i), []).append(i)
    table.pop(b"", None)
    return oc.Vocabulary(tok.eos_token_id, table)


def _llg_matcher(lt, schema: dict, mask: np.ndarray):
    import llguidance
    g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=DEFAULT_WHITESPACE)
    m = llguidance.LLMatcher(lt, g)
    m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)  # the first mask is part of it
    if m.is_error():
        raise RuntimeError(m.get_error())
    return m


def _outlines_guide(voc, schema: dict, mask: np.ndarray):
    import outlines_core as oc
    # one optional space between tokens: the layout closest to llguidance's above
    regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern=r"[ ]?")
    guide = oc.Guide(oc.Index(regex, voc))
    guide.write_mask_into(mask.ctypes.data, mask.size, 4)
    return guide


def walk(engine: str, tok: Tokenizer, rows: list[dict]) -> list[dict]:
    """Compile each schema, then mask + advance along its example's tokens."""
    mask = np.zeros(-(-tok.vocab_size // 32), np.int32)
    state = _llg_tokenizer(tok) if engine == "llguidance" else _outlines_vocabulary(tok)
    out = []
    for r in rows:
        t0 = time.perf_counter()
        if engine == "llguidance":
            m = _llg_matcher(state, r["schema"], mask)
            fill = lambda m=m: m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            advance, accepting = m.consume_token, m.is_accepting
        else:
            m = _outlines_guide(state, r["schema"], mask)
            fill = lambda m=m: m.write_mask_into(mask.ctypes.data, mask.size, 4)
            advance = lambda t, m=m: m.advance(t, return_tokens=False)
            accepting = m.is_finished
        compile_s = time.perf_counter() - t0
        ids = tok.encode(json.dumps(r["example"], separators=(", ", ": ")),
                         add_special_tokens=False)
        steps = []
        for t in ids:
            t1 = time.perf_counter()
            fill()
            if not _allowed(mask, t):
                raise RuntimeError(f"{engine} refused token {t} of {r['name']}'s example")
            advance(t)
            steps.append(time.perf_counter() - t1)
        out.append({"name": r["name"], "compile_ms": 1e3 * compile_s, "num_tokens": len(ids),
                    "median_step_us": 1e6 * statistics.median(steps),
                    "max_step_us": 1e6 * max(steps), "accepting": bool(accepting())})
    return out


def compile_one(engine: str, schema: dict) -> None:
    """Print the compile time of one schema (to the first mask) with one engine."""
    tok = Tokenizer.from_gguf(default_gguf_path())
    mask = np.zeros(-(-tok.vocab_size // 32), np.int32)
    if engine == "llguidance":
        lt = _llg_tokenizer(tok)
        t0 = time.perf_counter()
        _llg_matcher(lt, schema, mask)
    else:
        voc = _outlines_vocabulary(tok)
        t0 = time.perf_counter()
        _outlines_guide(voc, schema, mask)
    print(f"{1e3 * (time.perf_counter() - t0):.1f}")


def stress() -> list[dict]:
    """Compile time only, one process per engine and schema, under ``TIMEOUT_S``."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])}
    out = []
    for name, schema in STRESS.items():
        for engine in ("llguidance", "outlines_core"):
            code = (f"import json, compare; compare.compile_one({engine!r}, "
                    f"json.loads({json.dumps(json.dumps(schema))}))")
            try:
                p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   timeout=TIMEOUT_S, env=env, check=True)
                ms: float | None = float(p.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                ms = None
            out.append({"name": name, "engine": engine, "compile_ms": ms})
            shown = f"{ms:.1f} ms" if ms is not None else f"> {TIMEOUT_S:.0f} s (killed)"
            print(f"{name:<18}{engine:<15}{shown}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stress", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.stress:
        res: dict = {"stress": stress()}
    else:
        tok = Tokenizer.from_gguf(default_gguf_path())
        with open(SCHEMAS, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh]
        res = {"vocab": tok.vocab_size, "llguidance": walk("llguidance", tok, rows),
               "outlines_core": walk("outlines_core", tok, rows)}
        print(f"{'schema':<16}{'llg compile ms':>15}{'llg step us':>12}{'oc compile ms':>15}"
              f"{'oc step us':>12}   (step: median of mask + advance)")
        for x, y in zip(res["llguidance"], res["outlines_core"]):
            print(f"{x['name']:<16}{x['compile_ms']:>15.2f}{x['median_step_us']:>12.1f}"
                  f"{y['compile_ms']:>15.1f}{y['median_step_us']:>12.1f}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
