"""``dflash-gguf forecast``: stand-ins equal to the pipeline's output but for tensor data, made from the small files
and safetensors headers alone (from a local folder, or the loopback Hub by range request), a pair precheck refuses
refused before anything is built, and each configuration measured by b11434's llama-server at synthetic accepted
lengths. Asserts structure and parity, never speeds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import fixtures as mf
import gguf_compare
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli
from fixtures.drafters import make_dflash2_drafter, make_dspark_drafter, make_eagle3_drafter, write_mask_embedding
from fixtures.gemma4_assistant import make_gemma4_assistant

from dflash_gguf import made_cache
from dflash_gguf.convert.safetensors import read_raw_header
from dflash_gguf.forecast import ForecastOptions, make_standins
from dflash_gguf.forecast.standin import write_safetensors
from dflash_gguf.tune.curve import breadth_first, crossing, interpolate


def _qwen3(root: Path) -> tuple[Path, Path]:
    return (mf.make_qwen3_target(root / "t", llama_cpp_src=reference.require_llama_cpp_src()),
            mf.make_drafter(root / "d", target="qwen3"))


def _qwen35_moe(root: Path) -> tuple[Path, Path]:
    return (mf.make_qwen35_target(root / "t", llama_cpp_src=reference.require_llama_cpp_src(), moe=True),
            mf.make_drafter(root / "d", target="qwen35"))


def _gemma4_vision(root: Path) -> tuple[Path, Path]:
    return mf.make_gemma4_target(root / "t", towers="vision"), mf.make_drafter(root / "d", target="gemma4")


def _gemma4_assistant(root: Path) -> tuple[Path, Path]:
    return mf.make_gemma4_target(root / "t"), make_gemma4_assistant(root / "d")


def _qwen3_dspark(root: Path) -> tuple[Path, Path]:
    return (mf.make_qwen3_target(root / "t", llama_cpp_src=reference.require_llama_cpp_src()),
            make_dspark_drafter(root / "d"))


def _llama3_eagle3(root: Path) -> tuple[Path, Path]:
    return (mf.make_llama3_target(root / "t", llama_cpp_src=reference.require_llama_cpp_src()),
            make_eagle3_drafter(root / "d"))


def _qwen3_dflash2(root: Path) -> tuple[Path, Path]:
    """DFlash2 with its mask_embedding.pt (written by real torch), on a target whose embeddings the file needs."""
    reference.require_or_skip(reference.reference_available())
    target = mf.make_qwen3_target(root / "t", llama_cpp_src=reference.require_llama_cpp_src())
    drafter = make_dflash2_drafter(root / "d", config_overrides={"num_target_layers": 6})
    write_mask_embedding(drafter, reference.env.venv_python(reference.env.ref_venv_dir()))
    return target, drafter


PAIRS: dict[str, Callable[[Path], tuple[Path, Path]]] = {
    "dense-dflash": _qwen3, "moe-dflash": _qwen35_moe, "image-text-dflash": _gemma4_vision,
    "mtp-assistant": _gemma4_assistant, "dspark": _qwen3_dspark, "eagle3": _llama3_eagle3,
    "dflash2": _qwen3_dflash2}


# Our lineage evidence: a fingerprint of the target's embedding rows, so of tensor data (its shape part still agrees).
DATA_FINGERPRINTS = ("dflash_gguf.target.embd_fingerprint",)


def _same_but_data(ours: Path, real: Path) -> list[str]:
    """Every difference in keys (name, type, value, order) and tensors (name, order, type, shape) of two GGUFs."""
    problems = []
    kv_a, kv_b = gguf_compare.read_kv(ours), gguf_compare.read_kv(real)
    if list(kv_a) != list(kv_b):
        problems.append(f"keys: {list(kv_a)} vs {list(kv_b)}")
    for k in kv_a:
        if k in DATA_FINGERPRINTS and k in kv_b:
            if kv_a[k][1].split(":")[:4] != kv_b[k][1].split(":")[:4]:
                problems.append(f"key {k}: the fingerprints' shapes differ: {kv_a[k]!r:.60} vs {kv_b[k]!r:.60}")
        elif k in kv_b and kv_a[k] != kv_b[k]:
            problems.append(f"key {k}: {kv_a[k]!r:.120} vs {kv_b[k]!r:.120}")
    t_a, t_b = gguf_compare.read_tensors_fast(ours), gguf_compare.read_tensors_fast(real)
    if list(t_a) != list(t_b):
        problems.append("tensor names or order differ")
    problems += [f"tensor {n}: {t_a[n][:2]} vs {t_b[n][:2]}" for n in t_a if n in t_b and t_a[n][:2] != t_b[n][:2]]
    return problems


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_standins_are_the_pipelines_files_but_for_tensor_data(tmp_path: Path, pair: str) -> None:
    """The stand-in pair (from the configs, tokenizers and safetensors headers) has every key and value, every
    tensor name, its order, shape and type of what dflash-convert makes from the real checkpoints."""
    target, drafter = PAIRS[pair](tmp_path / "src")
    standins = make_standins(ForecastOptions(str(target), (str(drafter),), quant="Q4_K_M", mmproj=False))
    real = tmp_path / "real"
    made = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--quant", "Q4_K_M", "--no-mmproj",
                   "--outdir", real)
    assert made.returncode == 0, made.stdout + made.stderr
    doc = json.loads((real / "pair.json").read_text())
    assert _same_but_data(standins.target, real / doc["outputs"]["target"]["file"]) == []
    assert _same_but_data(standins.drafters[0], real / doc["outputs"]["drafter"]["file"]) == []
    assert gguf_compare.read_tensors_fast(standins.target) != gguf_compare.read_tensors_fast(
        real / doc["outputs"]["target"]["file"])  # the values are the stand-in's own
    assert not list(standins.folder.parent.rglob("*.safetensors"))  # the stand-in checkpoints are removed
    again = make_standins(ForecastOptions(str(target), (str(drafter),), quant="Q4_K_M", mmproj=False))
    assert again.reused and again.target == standins.target


def test_a_standin_file_keeps_the_header_with_finite_values(tmp_path: Path) -> None:
    header = {"__metadata__": {"format": "pt"},
              "b": {"dtype": "BF16", "shape": [3, 5], "data_offsets": [0, 30]},
              "a": {"dtype": "F8_E4M3", "shape": [4096], "data_offsets": [30, 4126]},
              "c": {"dtype": "F32", "shape": [2], "data_offsets": [4126, 4134]},
              "i": {"dtype": "I64", "shape": [1], "data_offsets": [4134, 4142]}}
    path = tmp_path / "model.safetensors"
    write_safetensors(path, header)
    assert read_raw_header(path)[0] == header
    raw = path.read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")
    f32 = np.frombuffer(raw[start + 4126:start + 4134], dtype=np.float32)
    bf16 = np.frombuffer(raw[start:start + 30], dtype=np.uint16).astype(np.uint32) << 16
    assert np.isfinite(f32).all() and f32.any() and np.isfinite(bf16.view(np.float32)).all() and bf16.any()
    fp8 = np.frombuffer(raw[start + 30:start + 4126], dtype=np.uint8)
    assert not ((fp8 & 0x7F) == 0x7F).any() and len(set(fp8.tolist())) > 100  # no NaN codes, not constant
    assert raw[start + 4134:start + 4142] == bytes(8)  # integers: zeros


def test_a_pair_precheck_refuses_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    target = mf.make_gemma4_target(tmp_path / "t")
    drafter = mf.make_drafter(tmp_path / "d", target="qwen3")
    proc = run_cli("dflash-gguf", "forecast", "--target", target, "--drafter", drafter)
    pipeline = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", tmp_path / "pair")
    precheck = run_cli("dflash-gguf", "precheck", drafter, target)
    assert proc.returncode == pipeline.returncode != 0, proc.stdout + proc.stderr  # one verdict, one code
    assert "pair.mask_token" in proc.stdout + proc.stderr and "pair.mask_token" in precheck.stdout
    assert precheck.returncode != 0 and "MUST NOT be served" in precheck.stdout
    assert not (made_cache.cache_root() / "standins").exists()


def test_the_curve_arithmetic() -> None:
    assert crossing([(1, 0.2), (2, 0.6), (3, 1.4)]) == pytest.approx(2.5)
    assert crossing([(1, 0.2), (3, 0.9)]) is None and crossing([(1, 1.1), (2, 2.0)]) == 1
    assert interpolate([(1, 0.2), (3, 1.0)], 2) == pytest.approx(0.6) and interpolate([(1, 0.2), (3, 1.0)], 4) is None
    assert breadth_first([1, 2, 3, 4, 5]) == [1, 5, 3, 2, 4]


def test_standins_from_the_hub_download_no_weights(tmp_path: Path) -> None:
    """From repo ids on the loopback Hub: the safetensors files are read by range request (their headers), never
    downloaded, and the stand-ins equal those made from the same folders on disk."""
    import hub_server
    from hub_server import FakeRepo

    target, drafter = _qwen3(tmp_path / "src")
    repos = {"Qwen/qwen3-tiny": FakeRepo({p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}),
             "z-lab/qwen3-tiny-DFlash-b16": FakeRepo({p.name: p.read_bytes() for p in drafter.iterdir()
                                                      if p.is_file()})}
    code = ("import json, sys; from dflash_gguf.forecast import ForecastOptions, make_standins; "
            "s = make_standins(ForecastOptions('Qwen/qwen3-tiny', ('z-lab/qwen3-tiny-DFlash-b16',), 'Q8_0')); "
            "print(json.dumps([str(s.target), str(s.drafters[0])]))")
    with hub_server.serve(repos) as hub:
        env = hub_server.client_env(hub.url, tmp_path / "hf") | {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                              stdin=subprocess.DEVNULL)
        touching = hub.requested("*.safetensors")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sizes = {f"{p.name}": p.stat().st_size for d in (target, drafter) for p in d.glob("*.safetensors")}
    assert touching and all(r.method == "GET" and r.range == "bytes=0-100000" for r in touching), touching
    assert max(sizes.values()) > 100_001  # so a range read of the header is not the whole file
    hub_target, hub_drafter = map(Path, json.loads(proc.stdout))
    local = make_standins(ForecastOptions(str(target), (str(drafter),), "Q8_0"))
    assert gguf_compare.diff(hub_target, local.target) == []
    assert gguf_compare.diff(hub_drafter, local.drafters[0]) == []


@pytest.mark.reference
def test_forecast_measures_each_length_with_llama_server(tmp_path: Path) -> None:
    """The target alone, then the drafter at n-max 2 at synthetic accepted lengths 1, 2 and 3 (b11434's
    --spec-synth-len), with the speed-up, break-even and memory in tune's vocabulary; a second forecast reuses the
    stand-ins."""
    reference.require_or_skip(reference.llama_cpp_available())
    target, drafter = _qwen3(tmp_path / "src")
    env = reference.llama_server_env() | {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    cmd = [str(Path(sys.executable).parent / "dflash-gguf"), "forecast", "--target", str(target), "--drafter",
           str(drafter), "--n-max", "2", "--repeats", "1", "--n-predict", "16", "--acceptance", "2.5", "--ctx", "2048",
           "--temperature", "0.7", "--memory-limit", "4G", "--json", "--", "-t", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["synthetic"] is True and doc["generation_tokens_per_second"] > 0 and doc["peak_rss"] > 0
    [config] = doc["configurations"]
    assert config["spec_type"] == "draft-dflash" and config["n_max"] == 2
    rows = config["lengths"]
    assert [r["acceptance_length"] for r in rows] == [1.0, 2.0, 3.0] and all(r["status"] == "ok" for r in rows)
    assert all(r["generation_tokens_per_second"] > 0 and r["speedup"] > 0 for r in rows)
    expected = crossing([(r["acceptance_length"], r["generation_tokens_per_second"]
                          / doc["generation_tokens_per_second"]) for r in rows])
    assert config["break_even_acceptance_length"] == (None if expected is None else round(expected, 3))
    assert config["drafter_rss"] is not None and config["drafter_rss"] > 0
    assert doc["shape"] == {"sampling": "temperature 0.7, seed 0 (given); top_k, top_p, min_p llama-server's default",
                            "parallel": 1, "context_per_client": 2048, "memory_limit_bytes": 4 * 2**30}
    for r in rows:  # tune's vocabulary, per synthetic length
        assert r["draft_sampling"] == "greedy" and r["parallel"] == 1 and r["skipped"] is None
        assert r["memory_bytes"] > r["drafter_memory_bytes"] > 0 and r["synthetic_acceptance_length"] == r[
            "acceptance_length"]
    assert config["memory_mib"]["drafter"]["kv"] > 0 and doc["target_alone"]["drafter_memory_bytes"] == 0
    [predicted] = doc["predicted"]
    assert predicted["acceptance_length"] == 2.5 and predicted["fastest"] in ("target alone", {
        "method": "draft-dflash", "drafter": config["drafter"], "spec_type": "draft-dflash", "n_max": 2})
    assert doc["standins"]["reused"] is False
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, stdin=subprocess.DEVNULL)
    assert again.returncode == 0 and json.loads(again.stdout)["standins"]["reused"] is True
    REFERENCE_COMPARISONS.append("forecast: llama-server --spec-synth-len over a grid")


def test_precheck_forecast_and_the_pipeline_refuse_a_projector_the_configs_rule_out(tmp_path: Path) -> None:
    """A Qwen3.5 checkpoint with a vision tower and no processor config: the pipeline cannot make its projector. From
    repo ids, precheck, forecast and dflash-convert all refuse it with the same code before any weight is fetched;
    --no-mmproj, which leaves the projector out, lets precheck pass."""
    import hub_server
    from hub_server import FakeRepo

    from dflash_gguf.errors import ConfigError

    target = mf.make_qwen35_target(tmp_path / "t", llama_cpp_src=reference.require_llama_cpp_src(),
                                   vision_tower=True)
    for name in ("processor_config.json", "preprocessor_config.json"):
        (target / name).unlink(missing_ok=True)
    drafter = mf.make_drafter(tmp_path / "d", target="qwen35")
    repos = {"Qwen/qwen35-tiny": FakeRepo({p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}),
             "z-lab/qwen35-tiny-DFlash": FakeRepo({p.name: p.read_bytes() for p in drafter.iterdir() if p.is_file()})}
    t, d = "Qwen/qwen35-tiny", "z-lab/qwen35-tiny-DFlash"
    with hub_server.serve(repos) as hub:
        env = hub_server.client_env(hub.url, tmp_path / "hf") | {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
        runs = {"precheck": run_cli("dflash-gguf", "precheck", d, t, env=env),
                "forecast": run_cli("dflash-gguf", "forecast", "--target", t, "--drafter", d, env=env),
                "convert": run_cli("dflash-convert", "--target", t, "--drafter", d, "--outdir", tmp_path / "pair",
                                   env=env)}
        weights = hub.requested("*.safetensors")
        text_only = run_cli("dflash-gguf", "precheck", "--no-mmproj", d, t, env=env)
    for name, proc in runs.items():
        assert proc.returncode == ConfigError.exit_code, (name, proc.stdout + proc.stderr)
        assert "image_mean" in proc.stderr and "--no-mmproj" in proc.stderr, (name, proc.stderr)
    assert weights == []  # refused from the configs: no weight file was asked for, not even a header
    assert text_only.returncode == 0, text_only.stdout + text_only.stderr
    assert not (tmp_path / "xdg" / "dflash-gguf" / "made" / "standins").exists()


def test_the_lengths_tune_measured_are_read_from_pair_json(tmp_path: Path, demo_pair: Path) -> None:
    """``forecast --acceptance pair.json``: per method and drafter file, the accepted length at its fastest
    configuration, as tune recorded it; a record without a tune measurement is refused with the way out."""
    from dflash_gguf.errors import InputError
    from dflash_gguf.forecast import acceptance_from_record

    folder = tmp_path / "pair"
    shutil.copytree(demo_pair, folder)
    with pytest.raises(InputError, match="Run dflash-gguf tune on it first"):
        acceptance_from_record(folder)
    manifest = folder / "pair.json"
    data = json.loads(manifest.read_text())
    row = {"status": "ok", "method": "draft-dflash", "drafter": "d.gguf", "synthetic_acceptance_length": None}
    data["tuning"] = {"status": "measured", "configurations": [
        {**row, "method": "target alone", "drafter": None, "mean_accepted_per_step": None,
         "generation_tokens_per_second": 50.0},
        {**row, "n_max": 4, "mean_accepted_per_step": 2.38, "generation_tokens_per_second": 70.0},
        {**row, "n_max": 15, "mean_accepted_per_step": 1.64, "generation_tokens_per_second": 45.0},
        {**row, "n_max": 2, "mean_accepted_per_step": 1.9, "generation_tokens_per_second": 90.0,
         "changed_output": True},  # not servable: not a length the drafter is served at
        {**row, "method": "draft-mtp (target's own head)", "drafter": None, "mean_accepted_per_step": 0.8,
         "generation_tokens_per_second": 60.0}]}
    manifest.write_text(json.dumps(data))
    assert acceptance_from_record(manifest) == acceptance_from_record(folder) == (1.8, 3.38)


@pytest.mark.reference
def test_forecast_measures_the_targets_own_mtp_head(tmp_path: Path) -> None:
    """A Qwen3.5 target with its MTP layer: its own head is forecast beside the drafter, each at the synthetic
    lengths its n-max allows."""
    reference.require_or_skip(reference.llama_cpp_available())
    target, drafter = _qwen35_moe(tmp_path / "src")
    env = reference.llama_server_env() | {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    cmd = [str(Path(sys.executable).parent / "dflash-gguf"), "forecast", "--target", str(target), "--drafter",
           str(drafter), "--no-mmproj", "--n-max", "1", "--repeats", "1", "--n-predict", "8", "--json", "--", "-t", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    by_method = {c["method"]: c for c in doc["configurations"]}
    assert set(by_method) == {"draft-mtp (target's own head)", "draft-dflash"}, by_method
    own = by_method["draft-mtp (target's own head)"]
    assert own["drafter"] is None and own["spec_type"] == "draft-mtp" and own["n_max"] == 1
    assert [r["acceptance_length"] for r in own["lengths"]] == [1.0, 2.0]
    assert all(r["status"] == "ok" and r["speedup"] > 0 for r in own["lengths"])
    REFERENCE_COMPARISONS.append("forecast: the target's own MTP head at --spec-synth-len")
