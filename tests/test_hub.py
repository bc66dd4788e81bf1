"""Repo ids through the real huggingface_hub client against a loopback Hub: precheck before weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fixtures as mf
from hub_server import FakeRepo, fake_hub

CLI = str(Path(sys.executable).parent / "dflash-gguf")


def _repo(folder: Path) -> FakeRepo:
    return FakeRepo({p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})


def _run(args: list[str], endpoint: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_XET": "1", "NO_PROXY": "127.0.0.1",
            "no_proxy": "127.0.0.1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_precheck_catches_a_qat_target_before_any_weights(tmp_path: Path) -> None:
    drafter = mf.make_drafter(tmp_path / "d", target="gemma4")
    vanilla = mf.make_gemma4_target(tmp_path / "v")
    qat = mf.make_gemma4_target(tmp_path / "q", qat=True)
    repos = {"z-lab/gemma4-12B-it-DFlash": _repo(drafter), "google/gemma-4-12B-it": _repo(vanilla),
             "google/gemma-4-12B-it-qat-q4_0-unquantized": _repo(qat)}
    with fake_hub(repos) as url:
        bad = _run(["precheck", "z-lab/gemma4-12B-it-DFlash", "google/gemma-4-12B-it-qat-q4_0-unquantized",
                    "--json"], url, tmp_path / "hf")
        good = _run(["precheck", "z-lab/gemma4-12B-it-DFlash", "google/gemma-4-12B-it"], url, tmp_path / "hf")
        missing = _run(["precheck", "z-lab/gemma4-12B-it-DFlash", "google/nope"], url, tmp_path / "hf")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    report = json.loads(bad.stdout)
    assert {c["id"]: c["status"] for c in report["checks"]}["lineage.derived_target"] == "fail"
    qat_sha = repos["google/gemma-4-12B-it-qat-q4_0-unquantized"].sha
    assert report["sources"]["target"] == f"google/gemma-4-12B-it-qat-q4_0-unquantized@{qat_sha}"
    assert good.returncode == 0, good.stdout + good.stderr
    assert missing.returncode == 9 and "Repository google/nope was not found" in missing.stderr
    cached = {p.name for p in (tmp_path / "hf").rglob("*") if p.is_file() or p.is_symlink()}
    assert "model.safetensors" not in cached and "tokenizer.json" not in cached  # configs and cards only
