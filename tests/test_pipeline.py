"""The pipeline end to end: ``dflash-convert --target --drafter`` from Hub repo ids (real huggingface_hub client
against the loopback Hub) or local folders to a verified, quantized pair with pair.json; precheck before any
weight, resume, Ctrl-C at every heavy stage, the dry-run plan, and serving the result with llama.cpp b11434."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import fixtures as mf
import hub_server
import numpy as np
import pytest
import reference
from click.testing import CliRunner
from conftest import REFERENCE_COMPARISONS, run_cli
from hub_server import FakeRepo

from dflash_gguf.cli import main

BIN = Path(sys.executable).parent
TARGET_REPO, DRAFTER_REPO = "google/gemma-4-12B-it", "z-lab/gemma4-12B-it-DFlash"
QAT_REPO = "google/gemma-4-12B-it-qat-q4_0-unquantized"
FINAL_T, FINAL_D = "gemma-4-12B-it-Q4_0.gguf", "dflash-gemma-4-12B-it-Q8_0.gguf"  # the drafter: llama.cpp's sidecar
# Never fetched: other weight formats and repo code beside the safetensors.
DECOYS = {"pytorch_model.bin": b"\0" * 64, "dflash.py": b"raise RuntimeError('remote code ran')\n",
          "model.onnx": b"\0" * 32}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _builtin_covers(target_dir: Path) -> bool:
    try:
        from dflash_gguf.convert.targets import builtin_family
    except ImportError:
        return False
    return builtin_family(target_dir) is not None


def _target_args(target_dir: Path) -> list[str]:
    """The built-in target converter when it covers the fixture, else llama.cpp b11434's own (guarded)."""
    if _builtin_covers(target_dir):
        return []
    reference.require_or_skip(reference.reference_available())
    return ["--llama-cpp", str(reference.env.llama_cpp_src())]


def _env(endpoint: str | None, home: Path) -> dict[str, str]:
    env = hub_server.client_env(endpoint or "", home) | {"HF_HUB_DISABLE_TELEMETRY": "1"}
    if not endpoint:
        del env["HF_ENDPOINT"]
    if reference.reference_available() is None:
        env["LLAMA_CPP_PYTHON"] = str(reference.env.venv_python(reference.env.ref_venv_dir()))
    return env


def _convert(args: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "dflash-convert"), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)


def _error(stderr: str) -> str:
    """The ``Error: ...`` paragraph (the Hub client's progress bars come before it on stderr)."""
    return stderr[stderr.index("Error: "):] if "Error: " in stderr else stderr


def _repo(folder: Path, extra: dict[str, bytes] | None = None) -> FakeRepo:
    return FakeRepo({p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} | (extra or {}))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline-fx")
    return {"drafter": mf.make_drafter(root / "d", target="gemma4"), "target": mf.make_gemma4_target(root / "t"),
            "qat": mf.make_gemma4_target(root / "q", qat=True)}


def _repos(folders: dict[str, Path]) -> dict[str, FakeRepo]:
    return {DRAFTER_REPO: _repo(folders["drafter"], DECOYS), TARGET_REPO: _repo(folders["target"]),
            QAT_REPO: _repo(folders["qat"])}


def _outputs(outdir: Path) -> dict[str, str]:
    """sha256 of every GGUF under its final name (pair.json and the work area aside)."""
    return {p.name: _sha(p) for p in sorted(outdir.glob("*.gguf")) if p.is_file()}


def _assert_no_partials(outdir: Path) -> None:
    assert not [p for p in outdir.rglob("*.partial")], list(outdir.rglob("*"))


@pytest.fixture(scope="module")
def hub_run(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One full run from repo ids against the loopback Hub (plus a dry run first), with the server's log."""
    work = tmp_path_factory.mktemp("hub-run")
    repos = _repos(folders)
    with hub_server.serve(repos) as hub:
        env = _env(hub.url, work / "hf")
        dry = _convert(["--target", TARGET_REPO, "--drafter", DRAFTER_REPO, "--dry-run", "--json",
                        *_target_args(folders["target"])], env, cwd=work)
        after_dry = list(hub.requests)
        run = _convert(["--target", TARGET_REPO, "--drafter", DRAFTER_REPO, "--json",
                        *_target_args(folders["target"])], env, cwd=work)
        requests = list(hub.requests)
    return {"work": work, "repos": repos, "dry": dry, "after_dry": after_dry, "run": run, "requests": requests,
            "outdir": work / "gemma4-12B-it-DFlash-pair", "target_args": _target_args(folders["target"])}


# ------------------------------------------------------------------------------------------ from the Hub


def test_full_run_from_repo_ids(hub_run: dict) -> None:
    run, outdir, repos = hub_run["run"], hub_run["outdir"], hub_run["repos"]
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads(run.stdout)
    manifest = json.loads((outdir / "pair.json").read_text())
    assert doc["status"] == manifest["status"] == "complete"
    assert sorted(_outputs(outdir)) == sorted([FINAL_T, FINAL_D])  # llama.cpp's naming; no BF16 intermediate left
    for side, name, type_name in (("target", FINAL_T, "q4_0"), ("drafter", FINAL_D, "q8_0")):
        out = manifest["outputs"][side]
        assert out["file"] == name and out["type"] == type_name
        assert out["sha256"] == _sha(outdir / name) and out["size"] == (outdir / name).stat().st_size
    assert manifest["sources"]["target"]["commit"] == repos[TARGET_REPO].sha
    assert manifest["sources"]["drafter"]["commit"] == repos[DRAFTER_REPO].sha
    assert manifest["tokenizer"]["origin"] == "synthesized"  # Gemma-4 ships no tokenizer.model
    assert manifest["verify"]["servable"] is True and manifest["verify"]["errors"] == 0
    assert manifest["serve"]["command"] == [  # names, run in the folder: pair.json may be published
        "llama-server", "-m", FINAL_T, "--model-draft", FINAL_D, "--spec-type",
        "draft-dflash", "--spec-draft-n-max", "4"]  # untuned: the evidence-backed default, not block_size - 1
    assert manifest["serve"]["measured"] is False and "not measured" in manifest["serve"]["note"]
    assert (outdir / "models.ini").read_text().splitlines()[3:] == [f"[{outdir.name}]", "spec-draft-n-max = 4"]
    assert manifest["tools"]["llama_cpp_build"] == "b11434" and manifest["tools"]["gguf"]
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub_run["requests"] if r.method == "GET"}
    assert not fetched & set(DECOYS), fetched  # never *.bin, onnx or repo code
    # the drafter records where it came from and which target file it is served with
    from dflash_gguf.verify import read_gguf

    kv = read_gguf(outdir / FINAL_D)
    assert kv.get("dflash_gguf.drafter.repo") == DRAFTER_REPO
    assert kv.get("dflash_gguf.drafter.revision") == repos[DRAFTER_REPO].sha
    assert kv.get("dflash_gguf.target.file") == FINAL_T
    assert kv.get("dflash_gguf.tokenizer.origin") == "synthesized"


def test_dry_run_lists_downloads_without_fetching_weights(hub_run: dict) -> None:
    dry, repos = hub_run["dry"], hub_run["repos"]
    assert dry.returncode == 0, dry.stdout + dry.stderr
    plan = json.loads(dry.stdout)["plan"]
    sizes = {(d["source"].split("@")[0], d["file"]): d["size"] for d in plan["downloads"]}
    drafter_files = repos[DRAFTER_REPO].files
    assert sizes[(DRAFTER_REPO, "model.safetensors")] == len(drafter_files["model.safetensors"])
    assert sizes[(TARGET_REPO, "tokenizer.json")] == len(repos[TARGET_REPO].files["tokenizer.json"])
    assert not any(f in DECOYS for _, f in sizes)
    assert [o["file"] for o in plan["outputs"] if o["kind"] == "final"] == [FINAL_T, FINAL_D]
    assert all(d["enough"] and d["needed"] > 0 for d in plan["disk"])
    weights = [r for r in hub_run["after_dry"] if r.method == "GET" and r.path.endswith(".safetensors")]
    assert weights == []  # the plan comes from the listing, not the bytes
    assert not (hub_run["work"] / "gemma4-12B-it-DFlash-pair-dry").exists()


def test_verify_finds_the_pair_from_pair_json_and_from_the_drafter(hub_run: dict) -> None:
    outdir = hub_run["outdir"]
    assert hub_run["run"].returncode == 0, hub_run["run"].stderr
    by_manifest = run_cli("dflash-verify", str(outdir / "pair.json"), "--json")
    assert by_manifest.returncode == 0, by_manifest.stdout
    report = json.loads(by_manifest.stdout)
    checks = {c["id"]: c["status"] for c in report["checks"]}
    assert checks["manifest.target"] == checks["manifest.drafter"] == "pass" and checks["pair.vocab"] == "pass"
    by_drafter = run_cli("dflash-verify", str(outdir / FINAL_D), "--json")
    assert by_drafter.returncode == 0, by_drafter.stdout
    assert json.loads(by_drafter.stdout)["inputs"]["target"] == str(outdir / FINAL_T)


def test_rerun_skips_every_stage_and_keeps_identical_outputs(hub_run: dict) -> None:
    outdir = hub_run["outdir"]
    before = _outputs(outdir)
    with hub_server.serve(hub_run["repos"]) as hub:
        again = _convert(["--target", TARGET_REPO, "--drafter", DRAFTER_REPO, "-v", *hub_run["target_args"]],
                         _env(hub.url, hub_run["work"] / "hf"), cwd=hub_run["work"])
        weights = [r for r in hub.requests if r.method == "GET" and r.path.endswith(".safetensors")]
    assert again.returncode == 0, again.stdout + again.stderr
    for side in ("target", "drafter"):  # the quantize stage, or the convert stage that quantized in one pass
        assert f"{side}.quantize: up to date, skipped" in again.stderr \
            or f"{side}.convert: up to date, skipped" in again.stderr, again.stderr
    assert "converting" not in again.stderr and "quantizing" not in again.stderr
    assert weights == []  # the Hub cache already holds the pinned commit
    assert _outputs(outdir) == before


def test_pinned_revision_is_used_for_every_file(folders: dict[str, Path], tmp_path: Path) -> None:
    repos = _repos(folders)
    old = repos[TARGET_REPO].sha
    newer = dict(repos[TARGET_REPO].files) | {"README.md": b"---\nlicense: other\n---\n# moved on\n"}
    repos[TARGET_REPO].push(newer)
    assert repos[TARGET_REPO].sha != old
    with hub_server.serve(repos) as hub:
        run = _convert(["--target", f"{TARGET_REPO}@{old}", "--drafter", DRAFTER_REPO, "--outdir",
                        str(tmp_path / "out"), *_target_args(folders["target"])], _env(hub.url, tmp_path / "hf"))
        target_files = [r.path for r in hub.requests if r.path.startswith(f"/{TARGET_REPO}/resolve/")]
    assert run.returncode == 0, run.stdout + run.stderr
    manifest = json.loads((tmp_path / "out" / "pair.json").read_text())
    assert manifest["sources"]["target"]["commit"] == old
    assert target_files and all(f"/resolve/{old}/" in p for p in target_files), target_files


def test_qat_target_stops_at_the_precheck_before_any_weight(folders: dict[str, Path], tmp_path: Path) -> None:
    with hub_server.serve(_repos(folders)) as hub:
        run = _convert(["--target", QAT_REPO, "--drafter", DRAFTER_REPO, "--outdir", str(tmp_path / "out")],
                       _env(hub.url, tmp_path / "hf"))
        fetched = hub.downloads()
    assert run.returncode == 6, run.stdout + run.stderr
    assert _error(run.stderr).startswith(f"Error: Precheck refused drafter {DRAFTER_REPO}@"), run.stderr
    assert "[lineage.derived_target]" in run.stderr and "--allow-derived-target" in run.stderr
    assert set(fetched) <= {"config.json", "README.md"}, fetched  # no weights, not even a tokenizer file
    assert not (tmp_path / "out").exists()


def test_missing_repo_has_its_own_exit_code(folders: dict[str, Path], tmp_path: Path) -> None:
    with hub_server.serve(_repos(folders)) as hub:
        run = _convert(["--target", "google/nope", "--drafter", DRAFTER_REPO], _env(hub.url, tmp_path / "hf"),
                       cwd=tmp_path)
    assert run.returncode == 9, run.stderr
    assert "google/nope" in _error(run.stderr)
    assert list(tmp_path.glob("*-pair")) == []


# ---------------------------------------------------------------------------------------- local folders


def _cli(args: list[str]) -> object:
    return CliRunner().invoke(main, ["convert", *args])


def _local_args(folders: dict[str, Path], outdir: Path, *extra: str) -> list[str]:
    return ["--target", str(folders["target"]), "--drafter", str(folders["drafter"]), "--outdir", str(outdir),
            *_target_args(folders["target"]), *extra]


@pytest.fixture(scope="module")
def clean_run(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """sha256 of the outputs of one uninterrupted run from the local folders (what every resume must end with)."""
    outdir = tmp_path_factory.mktemp("clean") / "pair"
    run = _convert(_local_args(folders, outdir), _env(None, outdir.parent / "hf"))
    assert run.returncode == 0, run.stdout + run.stderr
    return _outputs(outdir)


def test_target_gguf_with_a_qat_gguf_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    qat_gguf = _gguf_of(folders["qat"], tmp_path / "gemma-4-tiny-it-qat-q4_0-unquantized-BF16.gguf")
    outdir = tmp_path / "out"
    result = _cli(["--target", str(folders["target"]), "--drafter", str(folders["drafter"]), "--outdir", str(outdir),
                   "--target-gguf", str(qat_gguf)])
    assert result.exit_code == 6, result.output
    assert result.output.startswith(f"Error: --target-gguf {qat_gguf} was refused by dflash-verify: "), result.output
    assert "[lineage.derived_target]" in result.output
    assert not outdir.exists()


def test_target_gguf_used_as_given(folders: dict[str, Path], clean_run: dict[str, str], tmp_path: Path) -> None:
    """An unquantized target GGUF is quantized into the pair; the drafter is converted against --target."""
    given = _gguf_of(folders["target"], tmp_path / "gemma-4-tiny-it-BF16.gguf")
    outdir = tmp_path / "out"
    result = _cli(["--target", str(folders["target"]), "--drafter", str(folders["drafter"]), "--outdir", str(outdir),
                   "--target-gguf", str(given), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["options"]["target_method"] == "gguf" and doc["outputs"]["target"]["file"] == "gemma-4-tiny-it-Q4_0.gguf"
    assert given.is_file()  # the user's file is never removed
    assert doc["verify"]["servable"]


def _gguf_of(target_dir: Path, out: Path) -> Path:
    """A BF16 target GGUF: the built-in converter when it covers the target, else b11434's (guarded)."""
    if _builtin_covers(target_dir):
        from dflash_gguf.convert.targets import convert_target

        convert_target(target_dir, out)
    else:
        reference.require_or_skip(reference.reference_available())
        assert reference.run_reference_convert(target_dir, None, out).returncode == 0
    return out


def test_verify_failure_keeps_the_files_and_exits_1(folders: dict[str, Path], tmp_path: Path) -> None:
    """A target GGUF with the same config, tokenizer and names but other weights (a re-trained model): nothing
    before verify can tell, the drafter's recorded embedding fingerprint does."""
    retrained = Path(shutil.copytree(folders["target"], tmp_path / "retrained" / folders["target"].name))
    entries = mf.read_safetensors_raw(retrained / "model.safetensors")
    rng = np.random.default_rng(7)
    tensors = {}
    for name, _dtype, shape, raw in entries:
        widened = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
        tensors[name] = rng.normal(0, 0.02, shape).astype(np.float32) if "embed_tokens" in name else widened
    mf.write_safetensors(retrained / "model.safetensors", tensors)
    other = _gguf_of(retrained, tmp_path / "gemma-4-tiny-it-BF16.gguf")
    outdir = tmp_path / "out"
    result = _cli(["--target", str(folders["target"]), "--drafter", str(folders["drafter"]), "--outdir", str(outdir),
                   "--target-gguf", str(other)])
    assert result.exit_code == 1, result.output
    assert "lineage.fingerprint" in result.output and "MUST NOT be served" in result.output
    manifest = json.loads((outdir / "pair.json").read_text())
    assert manifest["status"] == "verify-failed" and manifest["verify"]["servable"] is False
    assert sorted(_outputs(outdir)) == ["dflash-gemma-4-tiny-it-Q8_0.gguf", "gemma-4-tiny-it-Q4_0.gguf"]  # kept


def test_unsupported_target_names_the_ways_out(folders: dict[str, Path], tmp_path: Path) -> None:
    target = Path(shutil.copytree(folders["target"], tmp_path / "odd-target"))
    cfg = json.loads((target / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (target / "config.json").write_text(json.dumps(cfg))
    result = _cli(["--target", str(target), "--drafter", str(folders["drafter"]), "--outdir", str(tmp_path / "o")])
    assert result.exit_code == 18, result.output  # NotCoveredError: neither converter mirrors it; llama.cpp's may
    assert "'FancyNewForCausalLM' (an architecture dflash-gguf does not know)" in result.output
    assert "--llama-cpp DIR" in result.output and "--target-model-dir" in result.output
    assert not (tmp_path / "o").exists()


def test_outfile_and_pipeline_options_do_not_mix(folders: dict[str, Path], tmp_path: Path) -> None:
    result = _cli(["--target", str(folders["target"]), "--drafter", str(folders["drafter"]), "--outfile",
                   str(tmp_path / "d.gguf"), "--keep-intermediate"])
    assert result.exit_code == 2 and "--keep-intermediate is a pipeline option" in result.output
    result = _cli(["--target", str(folders["target"]), "--drafter", str(folders["drafter"]), "--pair-with", "t.gguf"])
    assert result.exit_code == 2 and "--pair-with needs --outfile" in result.output


def test_dry_run_plan_for_local_folders(folders: dict[str, Path], tmp_path: Path) -> None:
    outdir = tmp_path / "out"
    result = _cli(_local_args(folders, outdir, "--dry-run", "--json", "--keep-intermediate"))
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)["plan"]
    assert plan["downloads"] == []
    kinds = {o["file"]: o["kind"] for o in plan["outputs"]}
    assert kinds == {"gemma-4-tiny-it-BF16.gguf": "intermediate", "gemma-4-tiny-it-Q4_0.gguf": "final",
                     "gemma4-tiny-it-DFlash-BF16.gguf": "intermediate", "dflash-gemma-4-tiny-it-Q8_0.gguf": "final"}
    weights = (folders["target"] / "model.safetensors").stat().st_size
    est = {o["file"]: o["estimated_size"] for o in plan["outputs"]}
    assert est["gemma-4-tiny-it-BF16.gguf"] == weights and est["gemma-4-tiny-it-Q4_0.gguf"] < weights / 3
    assert plan["disk"][0]["needed"] == sum(est.values())  # --keep-intermediate: everything stays
    assert not outdir.exists()


def test_refuses_up_front_when_the_disk_is_too_small(folders: dict[str, Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Seam: shutil.disk_usage (as in test_convert's free-space test); a tmpfs needs root and mount(8)."""
    real = shutil.disk_usage

    def small_disk(path: str | os.PathLike[str]) -> object:
        total, used, _ = real(path)
        return type(real(path))(total, used, 100_000)

    monkeypatch.setattr(shutil, "disk_usage", small_disk)
    outdir = tmp_path / "out"
    for extra in (["--dry-run"], []):
        result = _cli(_local_args(folders, outdir, *extra))
        assert result.exit_code == 10, result.output
        assert result.output.startswith(f"Error: Not enough disk space for the pair in {outdir}: about "), \
            result.output
        assert "MB is free. Free some space, choose another --outdir" in result.output.replace("\n", " ") \
            or "0.1 MB is free" in result.output
        assert not outdir.exists()


def test_resume_after_a_failure_ends_with_identical_outputs(folders: dict[str, Path], clean_run: dict[str, str],
                                                            tmp_path: Path) -> None:
    drafter = Path(shutil.copytree(folders["drafter"], tmp_path / folders["drafter"].name))
    outdir = tmp_path / "pair"
    blocker = outdir / "dflash-gemma-4-tiny-it-Q8_0.gguf"  # a folder where the drafter's output goes: the
    blocker.mkdir(parents=True)                            # drafter stage fails only when it writes
    local = {"target": folders["target"], "drafter": drafter}
    args = _local_args(local, outdir)
    env = _env(None, tmp_path / "hf")
    failed = _convert(args, env)
    assert failed.returncode not in (0, 1), failed.stdout + failed.stderr  # the drafter stage failed
    assert sorted(_outputs(outdir)) == ["gemma-4-tiny-it-Q4_0.gguf"]  # the target was finished and kept
    target_before = (outdir / "gemma-4-tiny-it-Q4_0.gguf").stat().st_mtime_ns
    assert json.loads((outdir / "pair.json").read_text())["status"] == "in-progress"
    _assert_no_partials(outdir)
    blocker.rmdir()
    resumed = _convert([*args, "-v"], env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "target.convert: up to date, skipped" in resumed.stderr  # converted and quantized in one pass
    assert (outdir / "gemma-4-tiny-it-Q4_0.gguf").stat().st_mtime_ns == target_before
    assert _outputs(outdir)["gemma-4-tiny-it-Q4_0.gguf"] == clean_run["gemma-4-tiny-it-Q4_0.gguf"]
    # the drafter records its folder, so the uninterrupted run to compare with reads the same copy
    uninterrupted = _convert(_local_args(local, tmp_path / "clean"), env)
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    assert _outputs(outdir) == _outputs(tmp_path / "clean")


# --------------------------------------------------------------------------------------------- Ctrl-C

# The child runs dflash-convert with a progress bar that, on the first update of one stage, writes a marker
# and waits (the stage is then mid-write with a .partial on disk) until the test sends SIGINT.
_PAUSE_AT = r"""
import pathlib, sys, time
from dflash_gguf.cli import convert as cli_convert
ready, stage = pathlib.Path(sys.argv[1]), sys.argv[2]

class PausingProgress:
    def __init__(self, desc):
        self.desc = desc
    def __call__(self, done, total):
        if self.desc == stage and not ready.exists():
            ready.write_text(f"{done}/{total}")
            time.sleep(120)
    def close(self):
        pass

cli_convert.Progress = PausingProgress
from dflash_gguf.cli import convert_main
sys.argv = ["dflash-convert", *sys.argv[3:]]
convert_main()
"""


def _interrupt_when(proc: subprocess.Popen[str], ready: Path, sig: int = signal.SIGINT) -> tuple[str, str]:
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the pipeline never reached the stage"
            time.sleep(0.05)
        proc.send_signal(sig)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize(("stage", "unfinished", "extra"), [
    # the built-in converters quantize in the same pass: then the final file is the one being written
    ("convert target", ["gemma-4-tiny-it-BF16.gguf", "gemma-4-tiny-it-Q4_0.gguf"], []),
    ("convert drafter", ["gemma4-tiny-it-DFlash-BF16.gguf", "dflash-gemma-4-tiny-it-Q8_0.gguf"], []),
    # --keep-intermediate keeps a BF16 file to quantize from, so each side has a quantize stage of its own
    ("quantize target", ["gemma-4-tiny-it-Q4_0.gguf"], ["--keep-intermediate"]),
    ("quantize drafter", ["dflash-gemma-4-tiny-it-Q8_0.gguf"], ["--keep-intermediate"]),
])
def test_ctrl_c_mid_stage_leaves_nothing_and_the_rerun_completes(stage: str, unfinished: list[str], extra: list[str],
                                                                 folders: dict[str, Path],
                                                                 clean_run: dict[str, str], tmp_path: Path) -> None:
    outdir, ready = tmp_path / "pair", tmp_path / "ready"
    args = _local_args(folders, outdir, *extra)
    env = _env(None, tmp_path / "hf")
    proc = subprocess.Popen([sys.executable, "-c", _PAUSE_AT, str(ready), stage, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    stdout, stderr = _interrupt_when(proc, ready)
    assert proc.returncode == 130, stdout + stderr
    assert "Interrupted; no output was left behind." in stderr and "Traceback" not in stderr
    assert not [name for name in unfinished if (outdir / name).exists()]
    _assert_no_partials(outdir)
    assert json.loads((outdir / "pair.json").read_text())["status"] == "in-progress"
    rerun = _convert(args, env)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert {k: v for k, v in _outputs(outdir).items() if k in clean_run} == clean_run


@pytest.mark.parametrize(("stage", "unfinished", "extra"), [
    ("convert target", ["gemma-4-tiny-it-BF16.gguf", "gemma-4-tiny-it-Q4_0.gguf"], []),  # the one pass
    ("quantize target", ["gemma-4-tiny-it-Q4_0.gguf"], ["--keep-intermediate"]),  # the quantizer
])
def test_sigterm_is_handled_like_ctrl_c(stage: str, unfinished: list[str], extra: list[str],
                                        folders: dict[str, Path], clean_run: dict[str, str], tmp_path: Path) -> None:
    """kill, docker stop, systemd and CI timeouts send SIGTERM: the partial is removed and the exit code is 143."""
    outdir, ready = tmp_path / "pair", tmp_path / "ready"
    args = _local_args(folders, outdir, *extra)
    env = _env(None, tmp_path / "hf")
    proc = subprocess.Popen([sys.executable, "-c", _PAUSE_AT, str(ready), stage, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    stdout, stderr = _interrupt_when(proc, ready, signal.SIGTERM)
    assert proc.returncode == 143, stdout + stderr
    assert "Terminated; no output was left behind." in stderr and "Traceback" not in stderr
    assert not [name for name in unfinished if (outdir / name).exists()]
    _assert_no_partials(outdir)
    rerun = _convert(args, env)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert {k: v for k, v in _outputs(outdir).items() if k in clean_run} == clean_run


class Stall:
    """Switches of the stalled download: ``armed`` makes the next GET of the drafter's weights stall after half
    the bytes; ``release`` lets it finish."""

    def __init__(self) -> None:
        self.armed, self.release = threading.Event(), threading.Event()


@pytest.fixture
def stall(monkeypatch: pytest.MonkeyPatch) -> Iterator[Stall]:
    """The loopback Hub, when armed, sends half of the drafter's weights and then holds the connection open."""
    switch = Stall()
    real_body = hub_server._Handler._body

    def body(self: hub_server._Handler, path: str, data: bytes, headers: dict[str, str]) -> None:
        if not switch.armed.is_set() or self.command != "GET" or path != "model.safetensors" \
                or self.origin != "cdn" or DRAFTER_REPO not in self.path or self.headers.get("Range"):
            return real_body(self, path, data, headers)
        switch.armed.clear()
        self.send_response(200)
        for k, v in {**headers, "Content-Length": str(len(data)), "Content-Type": "application/octet-stream"}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data[:len(data) // 2])
        self.wfile.flush()
        switch.release.wait(60)
        self.close_connection = True
        return None

    monkeypatch.setattr(hub_server._Handler, "_body", body)
    yield switch
    switch.release.set()


def test_ctrl_c_mid_download_then_resume(folders: dict[str, Path], tmp_path: Path, stall: Stall) -> None:
    home = tmp_path / "hf"
    repos = _repos(folders)

    def args(outdir: Path) -> list[str]:
        return ["--target", TARGET_REPO, "--drafter", DRAFTER_REPO, "--outdir", str(outdir),
                *_target_args(folders["target"])]

    with hub_server.serve(repos) as hub:
        env = _env(hub.url, home)
        uninterrupted = _convert(args(tmp_path / "clean"), env)
        assert uninterrupted.returncode == 0, uninterrupted.stdout + uninterrupted.stderr
        shutil.rmtree(home)  # same cache path (the drafter records its snapshot folder), empty again
        stall.armed.set()
        outdir = tmp_path / "pair"
        proc = subprocess.Popen([str(BIN / "dflash-convert"), *args(outdir)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while stall.armed.is_set() or not list(home.rglob("*.incomplete")):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the drafter download never started"
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            stall.release.set()
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 130, stdout + stderr
        assert "Traceback" not in stderr
        assert _outputs(outdir) == {}
        drafter_cache = home / "hub" / ("models--" + DRAFTER_REPO.replace("/", "--"))
        weights = repos[DRAFTER_REPO].files["model.safetensors"]
        for cached in drafter_cache.glob("snapshots/*/model.safetensors"):  # the client's worker may finish it
            assert cached.read_bytes() == weights  # never a half file under its name
        rerun = _convert(args(outdir), env)
    # (resuming the cut file itself with Range is the Hub layer's test: the client buffers 10 MB before writing)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert _outputs(outdir) == _outputs(tmp_path / "clean")


# --------------------------------------------------------------------------------- served by b11434


def _serve_pair_json(manifest: Path, port: int) -> tuple[int, object, str]:
    """Run exactly the llama-server command pair.json records, in the pair's folder, plus context size, threads,
    host and port."""
    cmd = json.loads(manifest.read_text())["serve"]["command"]
    assert cmd[0] == "llama-server"
    argv = [str(reference.llama_bin("llama-server")), *cmd[1:], "-c", "256", "-t", "1", "--host", "127.0.0.1",
            "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")} | {"GGML_NO_BACKTRACE": "1"}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(reference.env.llama_bin_dir()),
                                                          os.environ.get("LD_LIBRARY_PATH")) if p)
    log_path = manifest.parent.parent / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=manifest.parent)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if reference.http_json(url + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        status, body = reference.http_json(url + "/completion", {"prompt": "hello world", "n_predict": 16,
                                                                 "temperature": 0})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return status, body, log_path.read_text(errors="replace")


@pytest.mark.reference
def test_llama_server_serves_the_pair_with_the_recorded_command(hub_run: dict) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    assert hub_run["run"].returncode == 0, hub_run["run"].stderr
    status, body, log = _serve_pair_json(hub_run["outdir"] / "pair.json", reference.free_port())
    assert status == 200, body
    assert isinstance(body, dict) and body["timings"]["draft_n"] > 0  # the drafter drafted
    assert "block_size=16, mask_token_id=4, n_extract=2" in log
    REFERENCE_COMPARISONS.append("pipeline/llama-server")


@pytest.mark.reference
def test_llama_cpp_converter_target_matches_b11434(folders: dict[str, Path], tmp_path: Path) -> None:
    """--llama-cpp runs b11434's convert_hf_to_gguf.py on the tokenizer overlay: the BF16 target it makes is
    the one b11434 makes from the target folder itself."""
    reference.require_or_skip(reference.reference_available())
    outdir = tmp_path / "pair"
    run = _convert(["--target", str(folders["target"]), "--drafter", str(folders["drafter"]), "--outdir",
                    str(outdir), "--llama-cpp", str(reference.env.llama_cpp_src()), "--keep-intermediate"],
                   _env(None, tmp_path / "hf"))
    assert run.returncode == 0, run.stdout + run.stderr
    manifest = json.loads((outdir / "pair.json").read_text())
    assert manifest["options"]["target_method"] == "llama-cpp" and manifest["tokenizer"]["origin"] == "synthesized"
    ref = tmp_path / "ref.gguf"
    assert reference.run_reference_convert(folders["target"], None, ref, "bf16").returncode == 0
    assert _sha(outdir / "gemma-4-tiny-it-BF16.gguf") == _sha(ref)
    REFERENCE_COMPARISONS.append("pipeline/llama-cpp-target")


# ------------------------------------------------------------------------------------- Hub failures


def test_offline_with_a_warm_cache_completes(hub_run: dict, tmp_path: Path) -> None:
    """HF_HUB_OFFLINE=1 and no server: the pinned commit comes from the cache the first run filled."""
    assert hub_run["run"].returncode == 0, hub_run["run"].stderr
    env = _env("http://127.0.0.1:9", hub_run["work"] / "hf") | {"HF_HUB_OFFLINE": "1"}
    run = _convert(["--target", TARGET_REPO, "--drafter", DRAFTER_REPO, "--outdir", str(tmp_path / "out"),
                    *hub_run["target_args"]], env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert _outputs(tmp_path / "out") == _outputs(hub_run["outdir"])


@pytest.mark.parametrize(("spec", "code", "words"), [
    (f"{TARGET_REPO}@no-such-branch", 12, "no-such-branch"),
    ("google/gated-model", 11, "google/gated-model"),
])
def test_hub_errors_stop_before_anything_is_written(folders: dict[str, Path], tmp_path: Path, spec: str, code: int,
                                                    words: str) -> None:
    repos = _repos(folders) | {"google/gated-model": FakeRepo(_repos(folders)[TARGET_REPO].files, gated=True)}
    with hub_server.serve(repos) as hub:
        run = _convert(["--target", spec, "--drafter", DRAFTER_REPO], _env(hub.url, tmp_path / "hf"), cwd=tmp_path)
        weights = hub.requested("*.safetensors")
    assert run.returncode == code, run.stdout + run.stderr
    assert words in _error(run.stderr)
    assert weights == [] and list(tmp_path.glob("*-pair")) == []


def test_rerun_with_another_drafter_type_keeps_one_sidecar(folders: dict[str, Path], tmp_path: Path) -> None:
    """llama-server --models-dir takes the first dflash-* file of a folder and its last other GGUF as the model:
    a re-run that makes other files removes the earlier run's (still unchanged) outputs."""
    outdir = tmp_path / "pair"
    first = _cli(_local_args(folders, outdir, "--draft-quant", "q4_0"))
    assert first.exit_code == 0, first.output
    assert sorted(_outputs(outdir)) == ["dflash-gemma-4-tiny-it-Q4_0.gguf", "gemma-4-tiny-it-Q4_0.gguf"]
    again = _cli(_local_args(folders, outdir, "--quant", "q8_0"))
    assert again.exit_code == 0, again.output
    assert sorted(_outputs(outdir)) == ["dflash-gemma-4-tiny-it-Q8_0.gguf", "gemma-4-tiny-it-Q8_0.gguf"]
    doc = json.loads((outdir / "pair.json").read_text())
    assert doc["options"]["quant"] == "q8_0" and doc["options"]["draft_quant"] == "q8_0"
    assert doc["outputs"]["drafter"]["type"] == "q8_0" and doc["outputs"]["target"]["type"] == "q8_0"


@pytest.mark.reference
def test_auto_quantizer_converts_in_one_pass_even_with_llama_quantize_installed(
        folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With llama-quantize on hand, the default is still the compiled built-in in one pass (no BF16 file);
    --quantizer llama-quantize takes llama-quantize, and the two runs make the same tensors."""
    from dflash_gguf.quantize.kernels import kernel_path

    reference.require_or_skip(reference.llama_cpp_available())
    if kernel_path() != "compiled":
        pytest.fail("the compiled kernels are not built: reinstall with a C compiler (pip install -e '.[test]')")
    import gguf_compare

    monkeypatch.setenv("LLAMA_QUANTIZE", str(reference.llama_bin("llama-quantize")))
    runs = {}
    for quantizer in ("auto", "llama-quantize"):
        outdir = tmp_path / quantizer
        result = _cli(_local_args(folders, outdir, "--quantizer", quantizer))
        assert result.exit_code == 0, result.output
        runs[quantizer] = (outdir, json.loads((outdir / "pair.json").read_text()))
    auto, by_llama = runs["auto"][1], runs["llama-quantize"][1]
    assert auto["outputs"]["target"]["made_by"] == "built-in converter and quantizer in one pass"
    assert auto["tools"]["quantizer"] == "builtin"
    assert by_llama["outputs"]["target"]["made_by"].startswith("llama-quantize quantizer: version:")
    assert by_llama["tools"]["quantizer"].startswith("llama-quantize ")
    for side in ("target", "drafter"):
        ours, ref = (runs[q][0] / runs[q][1]["outputs"][side]["file"] for q in ("auto", "llama-quantize"))
        assert gguf_compare.read_tensors(ours) == gguf_compare.read_tensors(ref), side
    REFERENCE_COMPARISONS.append("pipeline auto (one pass) vs --quantizer llama-quantize")
