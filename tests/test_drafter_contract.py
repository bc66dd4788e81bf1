"""One drafter contract: the precheck, the ``--outfile`` converter and the pipeline read a drafter through the
same interpreter (``dflash_gguf.drafters``), so they give the same verdict and the same exit code.

Every drafter fixture variant goes through all three. The converter and the pipeline must agree on the exit
code; the precheck (configs and cards only) must refuse exactly the variants whose config is what refuses them,
and never one the converter takes. Variants refused for their tensors are invisible to a config-level check:
there the precheck passes and the pipeline stops at conversion with the converter's code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fixtures as mf
import pytest
from conftest import run_cli

# Variants refused for their weights, not their config.
TENSOR_LEVEL = {"fc_width_wrong", "missing_tensor", "unexpected_tensor", "d2t"}


@pytest.fixture(scope="module")
def gemma_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mf.make_gemma4_target(tmp_path_factory.mktemp("contract-target"))


@pytest.mark.parametrize("variant", sorted(mf.VARIANTS))
def test_precheck_converter_and_pipeline_agree(variant: str, gemma_target: Path, tmp_path: Path) -> None:
    drafter = mf.make_drafter(tmp_path, target="gemma4", variant=variant)
    outfile = run_cli("dflash-convert", "--drafter", drafter, "--target", gemma_target, "--outfile",
                      tmp_path / "d.gguf")
    pipeline = run_cli("dflash-convert", "--drafter", drafter, "--target", gemma_target, "--outdir", tmp_path / "pair")
    precheck = run_cli("dflash-gguf", "precheck", drafter, gemma_target, "--json")
    assert precheck.returncode in (0, 1), precheck.stderr
    report = json.loads(precheck.stdout)
    refused = [c for c in report["checks"] if c["status"] == "fail" and c["severity"] == "error"]

    # the pipeline exits as the converter does (a pair the converter makes, verify may still refuse: exit 1)
    if outfile.returncode == 0:
        assert pipeline.returncode in (0, 1), pipeline.stdout + pipeline.stderr
    else:
        assert pipeline.returncode == outfile.returncode, (outfile.stderr, pipeline.stderr)
    # the precheck refuses exactly what the converter refuses for its config
    if variant in TENSOR_LEVEL:
        assert outfile.returncode != 0 and not refused, refused
    else:
        assert bool(refused) == (outfile.returncode != 0), (refused, outfile.stderr)
    if refused:  # the same rule says so, with the same words
        assert refused[0]["message"].split(" ", 1)[1][:60] in outfile.stderr, (refused[0], outfile.stderr)


def test_a_top_level_mask_id_is_accepted_by_every_command(gemma_target: Path, tmp_path: Path) -> None:
    drafter = mf.make_drafter(tmp_path, target="gemma4", variant="mask_top_level_only")
    outfile = run_cli("dflash-convert", "--drafter", drafter, "--target", gemma_target, "--outfile",
                      tmp_path / "d.gguf")
    assert outfile.returncode == 0 and "note: mask_token_id read from the top level" in outfile.stdout
    pipeline = run_cli("dflash-convert", "--drafter", drafter, "--target", gemma_target, "--outdir", tmp_path / "pair")
    assert pipeline.returncode == 0, pipeline.stdout + pipeline.stderr
    precheck = run_cli("dflash-gguf", "precheck", drafter, gemma_target)
    assert precheck.returncode == 0 and "mask_token_id read from the top level" in precheck.stdout


def test_a_drafter_folder_without_config_is_one_error(gemma_target: Path, tmp_path: Path) -> None:
    drafter = mf.make_drafter(tmp_path, target="gemma4")
    (drafter / "config.json").unlink()
    runs = [run_cli("dflash-convert", "--drafter", drafter, "--target", gemma_target, "--outfile",
                    tmp_path / "d.gguf"),
            run_cli("dflash-convert", "--drafter", drafter, "--target", gemma_target, "--outdir", tmp_path / "pair"),
            run_cli("dflash-gguf", "precheck", drafter, gemma_target)]
    messages = {r.stderr.strip() for r in runs}
    assert [r.returncode for r in runs] == [3, 3, 3], [r.stderr for r in runs]
    assert len(messages) == 1 and f"{drafter / 'config.json'} does not exist" in messages.pop()
    assert not (tmp_path / "d.gguf").exists() and not (tmp_path / "pair").exists()


def test_target_folder_without_config_is_one_error(gemma_target: Path, tmp_path: Path) -> None:
    drafter = mf.make_drafter(tmp_path, target="gemma4")
    target = Path(shutil.copytree(gemma_target, tmp_path / "t"))
    (target / "config.json").unlink()
    runs = [run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outfile", tmp_path / "d.gguf"),
            run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outdir", tmp_path / "pair"),
            run_cli("dflash-gguf", "precheck", drafter, target)]
    assert [r.returncode for r in runs] == [3, 3, 3], [r.stderr for r in runs]
    assert all(f"{target / 'config.json'} does not exist" in r.stderr for r in runs)
