"""pair.json has one schema: the typed records the pipeline writes are the ones every reader reads, and files
written by earlier versions (a serve section without the measured plan's keys) still read and still resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import run_cli

from dflash_gguf.pipeline.manifest import Manifest, ServePlan, read_manifest

# the serve section pair.json had before the measured serve plan (no method, p-min, preset or model)
EARLIER_SERVE_KEYS = ("command", "shell", "n_max", "measured", "note", "models_dir", "models_preset", "hub")


def test_the_writer_and_the_reader_agree_on_every_byte(demo_pair: Path) -> None:
    written = json.loads((demo_pair / "pair.json").read_text())
    assert Manifest.load(demo_pair).to_json() == written
    record = read_manifest(demo_pair / "pair.json")
    assert record.serve is not None and record.serve.to_json() == written["serve"]
    assert record.outputs.to_json() == written["outputs"]
    assert ServePlan.from_json(written["serve"]) == record.serve


def test_a_pair_json_of_an_earlier_version_reads_verifies_and_resumes(demo_pair: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(demo_pair, tmp_path / "pair"))
    doc = json.loads((folder / "pair.json").read_text())
    doc["serve"] = {k: doc["serve"][k] for k in EARLIER_SERVE_KEYS}
    (folder / "pair.json").write_text(json.dumps(doc))

    record = read_manifest(folder / "pair.json")
    assert record.serve is not None and record.serve.method == "draft-dflash" and record.serve.uses_drafter
    assert record.serve.shell == doc["serve"]["shell"] and record.serve.preset == {}
    verified = run_cli("dflash-verify", folder / "pair.json")
    assert verified.returncode == 0, verified.stdout + verified.stderr

    # the demo's own sources: the stage keys name them by path and content
    target = demo_pair.parent / "targets" / "gemma-4-tiny-it"
    drafter = demo_pair.parent / "drafters" / "gemma4-tiny-it-DFlash"
    again = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", folder, "-v")
    assert again.returncode == 0, again.stdout + again.stderr
    for side in ("target", "drafter"):
        assert f"{side}.convert: up to date, skipped" in again.stderr, again.stderr
    rewritten = json.loads((folder / "pair.json").read_text())
    assert set(rewritten["serve"]) > set(EARLIER_SERVE_KEYS)  # the current schema, written back
