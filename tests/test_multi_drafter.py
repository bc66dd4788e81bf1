"""Several drafters for one target in one run: each converted under its sidecar name in ``drafters/``, the one
to serve linked beside the target (llama.cpp's folder layout holds one target and one sidecar), verify and tune
over them all, and the serve command and ``models.ini`` naming the measured winner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fixtures as mf
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli
from fixtures.drafters import make_gemma4_dspark_drafter

from dflash_gguf.sidecar import sidecars_beside

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("multi")


@pytest.fixture(scope="module")
def gemma4(work: Path) -> Path:
    return mf.make_gemma4_target(work / "targets")


@pytest.fixture(scope="module")
def dflash(work: Path) -> Path:
    return mf.make_drafter(work / "drafters", target="gemma4")


@pytest.fixture(scope="module")
def dspark(work: Path) -> Path:
    return make_gemma4_dspark_drafter(work / "drafters", config_overrides={"final_logit_softcapping": None})


@pytest.fixture(scope="module")
def pair(gemma4: Path, dflash: Path, dspark: Path, work: Path) -> Path:
    outdir = work / "pair"
    run = run_cli("dflash-convert", "--target", gemma4, "--drafter", dflash, "--drafter", dspark, "--outdir", outdir)
    assert run.returncode == 0, run.stdout + run.stderr
    return outdir


def test_one_run_makes_one_target_and_every_drafter(pair: Path) -> None:
    manifest = json.loads((pair / "pair.json").read_text())
    assert manifest["status"] == "complete"
    made = manifest["outputs"]["drafters"]
    assert [d["kind"] for d in made] == ["dflash", "dspark"] and all(d["verify"]["servable"] for d in made)
    assert [Path(d["file"]).parent.name for d in made] == ["drafters", "drafters"]
    for d in made:
        assert (pair / d["file"]).is_file()
    # llama.cpp's layout: one target, one sidecar (untuned: the first --drafter), the same bytes as its candidate
    targets = [p for p in pair.glob("*.gguf") if not p.name.startswith(("dflash-", "dspark-"))]
    served = sidecars_beside(targets[0])
    assert len(targets) == 1 and [p.name for p in served] == [Path(made[0]["file"]).name]
    assert os.path.samefile(served[0], pair / made[0]["file"]) or served[0].read_bytes() == \
        (pair / made[0]["file"]).read_bytes()
    assert manifest["outputs"]["drafter"]["file"] == served[0].name
    assert manifest["outputs"]["drafter"]["links_to"] == made[0]["file"]
    assert "--spec-type draft-dflash" in manifest["serve"]["with_drafter"] and not manifest["serve"]["measured"]


def test_verify_judges_every_drafter_of_the_folder(pair: Path) -> None:
    run = run_cli("dflash-verify", pair / "pair.json", "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    checks = {c["id"]: c for c in json.loads(run.stdout)["checks"]}
    others = [c for cid, c in checks.items() if cid.startswith("pair.drafters.")]
    assert len(others) == 1 and others[0]["status"] == "pass" and "dspark-" in others[0]["id"], others
    assert all(checks[cid]["status"] == "pass" for cid in checks if cid.startswith("manifest.")), checks
    assert sum(cid.startswith("manifest.") for cid in checks) == 3  # target, the served drafter, the other one
    folder = run_cli("dflash-verify", pair, "--json")  # the folder stands for its pair.json
    assert folder.returncode == 0 and json.loads(folder.stdout)["checks"] == json.loads(run.stdout)["checks"]


def test_a_rerun_reuses_every_output(gemma4: Path, dflash: Path, dspark: Path, pair: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in [*pair.glob("*.gguf"), *pair.glob("drafters/*.gguf")]}
    run = run_cli("dflash-convert", "--target", gemma4, "--drafter", dflash, "--drafter", dspark, "--outdir", pair,
                  "-v")
    assert run.returncode == 0, run.stdout + run.stderr
    for side in ("target.convert", "drafter.convert", "drafter2.convert"):
        assert f"{side}: up to date, skipped" in run.stderr, run.stderr[-3000:]
    assert all(p.stat().st_mtime_ns == t for p, t in before.items() if p.parent.name == "drafters")


def test_two_drafters_of_one_kind_are_refused_before_anything_is_written(gemma4: Path, dflash: Path,
                                                                         tmp_path: Path) -> None:
    other = mf.make_drafter(tmp_path / "other", target="gemma4")
    outdir = tmp_path / "pair"
    run = run_cli("dflash-convert", "--target", gemma4, "--drafter", dflash, "--drafter", other, "--outdir", outdir)
    assert run.returncode == 2, run.stderr
    assert "are drafters of the same kind" in run.stderr and "two --outdir" in run.stderr
    assert not outdir.exists()


def test_outfile_takes_one_drafter(gemma4: Path, dflash: Path, dspark: Path, tmp_path: Path) -> None:
    run = run_cli("dflash-convert", "--target", gemma4, "--drafter", dflash, "--drafter", dspark, "--outfile",
                  tmp_path / "d.gguf")
    assert run.returncode == 2 and "--outfile converts one drafter" in run.stderr, run.stderr


@pytest.mark.reference
def test_a_dflash_drafter_and_an_mtp_assistant_from_the_loopback_hub(gemma4: Path, dflash: Path,
                                                                    tmp_path: Path) -> None:
    """One run, two Hub drafters of one Gemma-4 target: one target, the DFlash and the MTP sidecars, and tune
    ranking the three configurations. The measured winner (whichever it is on this machine) is what pair.json's
    serve command, models.ini and the folder's one sidecar name; when the target alone wins, no sidecar is left
    beside it. ``dflash-gguf tune pair.json`` then measures them all again and re-arranges the folder."""
    import hub_server
    from fixtures.gemma4_assistant import make_gemma4_assistant
    from hub_server import FakeRepo

    reference.require_or_skip(reference.llama_cpp_available())
    assistant = make_gemma4_assistant(tmp_path / "a")
    files = lambda d: FakeRepo({p.name: p.read_bytes() for p in d.iterdir() if p.is_file()})  # noqa: E731
    repos = {"z-lab/gemma4-tiny-it-DFlash": files(dflash), "google/gemma-4-tiny-it-assistant": files(assistant),
             "google/gemma-4-tiny-it": files(gemma4)}
    outdir = tmp_path / "pair"
    with hub_server.serve(repos) as hub:
        env = hub_server.client_env(hub.url, tmp_path / "hf") | {"LLAMA_QUANTIZE": ""}
        run = subprocess.run([str(BIN / "dflash-convert"), "--target", "google/gemma-4-tiny-it", "--drafter",
                              "z-lab/gemma4-tiny-it-DFlash", "--drafter", "google/gemma-4-tiny-it-assistant",
                              "--outdir", str(outdir), "--tune", "--tune-budget", "20", "--tune-flags", "-t 1",
                              "--tune-methods", "drafters",
                              "--llama-server", str(reference.llama_bin("llama-server"))], capture_output=True,
                             text=True, env=env, timeout=900, stdin=subprocess.DEVNULL)
    assert run.returncode in (0, 15), run.stdout + run.stderr  # 15: a random-weight drafter may collapse
    assert "ranking (each method and drafter at its fastest configuration):" in run.stdout, run.stdout
    manifest = json.loads((outdir / "pair.json").read_text())
    made = manifest["outputs"]["drafters"]
    assert [d["kind"] for d in made] == ["dflash", "mtp"] and all(d["verify"]["servable"] for d in made), made
    assert [Path(d["file"]).name.split("-")[0] for d in made] == ["dflash", "mtp"]
    assert len([p for p in outdir.glob("*.gguf") if not p.name.startswith(("dflash-", "mtp-"))]) == 1
    ranked = [r["drafter"] for r in manifest["tuning"]["ranking"]]
    assert sorted(ranked, key=str) == sorted([None, *(Path(d["file"]).name for d in made)], key=str), ranked
    spec_types = {c["drafter"]: c["spec_type"] for c in manifest["tuning"]["configurations"] if c["drafter"]}
    assert sorted(spec_types.values()) == ["draft-dflash", "draft-mtp"], spec_types
    _serves_the_winner(outdir, manifest)
    again = run_cli("dflash-gguf", "tune", outdir / "pair.json", "--quick", "--methods", "drafters", "--llama-server",
                    reference.llama_bin("llama-server"), "--", "-t", "1")
    assert again.returncode in (0, 15), again.stdout + again.stderr
    manifest = json.loads((outdir / "pair.json").read_text())
    assert len(manifest["tuning"]["ranking"]) == 3
    _serves_the_winner(outdir, manifest)
    REFERENCE_COMPARISONS.append("pipeline/loopback-hub/dflash+mtp/tune")


def _serves_the_winner(outdir: Path, manifest: dict) -> None:
    tuning, serve = manifest["tuning"], manifest["serve"]
    ranked = [r["drafter"] for r in tuning["ranking"]]
    target = outdir / manifest["outputs"]["target"]["file"]
    beside = [p.name for p in sidecars_beside(target)]
    winner = tuning["best"]["drafter"]  # a file name, or None for the target alone
    assert ranked[0] == winner, (ranked, tuning["best"])
    if winner is None:
        assert beside == [] and "--model-draft" not in serve["command"] and serve["uses_drafter"] is False
    else:
        assert beside == [winner] and serve["command"][serve["command"].index("--model-draft") + 1] == \
            str((outdir / winner).absolute())
        assert manifest["outputs"]["drafter"]["file"] == winner
