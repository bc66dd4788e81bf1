"""The projector in the pipeline, verify and publish: made beside the target when the target has vision or audio
towers (its own stage, record, dry-run line and type), left out with --no-mmproj, refused before anything is
written when the checkpoint lacks what it needs, judged against the target by verify (a projector of another
target refused), served with --mmproj and uploaded with the pair."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import fixtures as mf
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, llama_cpp_src, run_cli

from dflash_gguf.convert.targets import convert_projector, convert_target
from dflash_gguf.errors import ConfigError
from dflash_gguf.pipeline.manifest import read_manifest, sha256_file
from dflash_gguf.publish import plan_publish
from dflash_gguf.verify import read_gguf, verify_files
from dflash_gguf.verify.projector import B11434_PROJECTOR_TYPES, check_projector

PROJECTOR = "mmproj-gemma-4-tiny-it-F16.gguf"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mm-sources")
    return {"target": mf.make_gemma4_target(root, towers="vision_audio"),
            "drafter": mf.make_drafter(root / "d", target="gemma4")}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Path]) -> Path:
    out = tmp_path_factory.mktemp("mm-pair") / "pair"
    proc = run_cli("dflash-convert", "--target", sources["target"], "--drafter", sources["drafter"], "--outdir", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_the_pipeline_makes_records_verifies_and_serves_the_projector(pair: Path) -> None:
    assert sorted(p.name for p in pair.glob("*.gguf")) == [
        "dflash-gemma-4-tiny-it-Q8_0.gguf", "gemma-4-tiny-it-Q4_0.gguf", PROJECTOR]
    record = read_manifest(pair / "pair.json")
    assert record.projector is not None and record.projector.file == PROJECTOR
    assert record.projector.sha256 == sha256_file(pair / PROJECTOR) and record.projector.type == "f16"
    assert record.serve is not None
    command = list(record.serve.command)
    assert command[command.index("--mmproj") + 1] == PROJECTOR  # by name: the commands run in the folder
    absolute = record.serve.command_in(pair)
    assert absolute[absolute.index("--mmproj") + 1] == str((pair / PROJECTOR).absolute())
    assert "--no-mmproj" in record.serve.note
    proc = run_cli("dflash-verify", pair / "pair.json", "--json")
    assert proc.returncode == 0, proc.stdout
    checks = {c["id"]: c["status"] for c in json.loads(proc.stdout)["checks"]}
    assert {k: v for k, v in checks.items() if k.startswith("projector.") or k == "manifest.projector"} == {
        "projector.format": "pass", "projector.type": "pass", "projector.target": "pass", "projector.width": "pass",
        "projector.markers": "pass", "projector.lineage": "pass", "manifest.projector": "pass"}


def test_a_rerun_reuses_the_projector_and_another_type_replaces_it(pair: Path, sources: dict[str, Path]) -> None:
    before = (pair / PROJECTOR).stat().st_mtime_ns
    proc = run_cli("dflash-convert", "--target", sources["target"], "--drafter", sources["drafter"], "--outdir", pair,
                   "-v")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (pair / PROJECTOR).stat().st_mtime_ns == before and "projector: up to date, skipped" in proc.stderr
    proc = run_cli("dflash-convert", "--target", sources["target"], "--drafter", sources["drafter"], "--outdir", pair,
                   "--mmproj-type", "q8_0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in pair.glob("mmproj-*")) == ["mmproj-gemma-4-tiny-it-Q8_0.gguf"]  # one per folder
    assert read_manifest(pair / "pair.json").projector.type == "q8_0"  # type: ignore[union-attr]
    proc = run_cli("dflash-convert", "--target", sources["target"], "--drafter", sources["drafter"], "--outdir", pair)
    assert proc.returncode == 0 and sorted(p.name for p in pair.glob("mmproj-*")) == [PROJECTOR]


def test_no_mmproj_leaves_it_out_and_dry_run_lists_it(tmp_path: Path, sources: dict[str, Path]) -> None:
    args = ("dflash-convert", "--target", sources["target"], "--drafter", sources["drafter"], "--outdir")
    dry = run_cli(*args, tmp_path / "dry", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert re.search(rf"^  {re.escape(PROJECTOR)}  ~\d", dry.stdout, re.M), dry.stdout
    assert not (tmp_path / "dry").exists() or not list((tmp_path / "dry").glob("*.gguf"))
    text_only = run_cli(*args, tmp_path / "text", "--no-mmproj")
    assert text_only.returncode == 0, text_only.stdout + text_only.stderr
    assert not list((tmp_path / "text").glob("mmproj-*"))
    record = read_manifest(tmp_path / "text" / "pair.json")
    assert record.projector is None and record.serve is not None and "--mmproj" not in record.serve.command
    conflict = run_cli(*args, tmp_path / "x", "--no-mmproj", "--mmproj-type", "f16")
    assert conflict.returncode == 2 and "--no-mmproj" in conflict.stdout + conflict.stderr


def test_a_checkpoint_without_image_statistics_is_refused_before_anything_is_written(
        tmp_path: Path, sources: dict[str, Path]) -> None:
    target = mf.make_gemma4_target(tmp_path / "t", towers="vision")
    processor = target / "processor_config.json"
    cfg = json.loads(processor.read_text())
    for section in (cfg, cfg.get("image_processor") or {}):
        section.pop("image_mean", None)
    processor.write_text(json.dumps(cfg))
    out = tmp_path / "pair"
    proc = run_cli("dflash-convert", "--target", target, "--drafter", sources["drafter"], "--outdir", out)
    assert proc.returncode == ConfigError.exit_code, proc.stdout + proc.stderr
    assert "image_mean" in proc.stderr and "processor_config.json" in proc.stderr and "--no-mmproj" in proc.stderr
    assert not list(out.rglob("*.gguf")) and not list(out.rglob("*.partial"))


def test_convert_target_writes_the_projector_alone(tmp_path: Path, sources: dict[str, Path]) -> None:
    out = tmp_path / "mmproj.gguf"
    proc = run_cli("dflash-gguf", "convert-target", sources["target"], "--mmproj", "--outtype", "q8_0",
                   "--outfile", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    direct = convert_projector(sources["target"], tmp_path / "direct.gguf", "q8_0")
    assert sha256_file(out) == direct.sha256
    usage = run_cli("dflash-gguf", "convert-target", sources["target"], "--mmproj", "--quant", "q4_0",
                    "--outfile", tmp_path / "y.gguf")
    assert usage.returncode == 2


def test_verify_refuses_a_projector_of_another_target(tmp_path: Path, pair: Path) -> None:
    qwen = mf.make_qwen35_target(tmp_path, llama_cpp_src=reference.require_llama_cpp_src(), vision_tower=True)
    foreign = convert_projector(qwen, tmp_path / "mmproj-qwen.gguf", "f16").outfile
    target = pair / "gemma-4-tiny-it-Q4_0.gguf"
    report = verify_files(foreign, target)
    failed = {r.id for r in report.errors}
    assert {"projector.target", "projector.lineage"} <= failed, report.to_dict()
    assert report.exit_code == 1
    # the same projector with its own target passes
    own = convert_target(qwen, tmp_path / "qwen.gguf", "bf16").outfile
    assert verify_files(foreign, own).errors == []
    # a target of another width (the header's embedding_length as a larger size would have it): the width check
    # names llama-server's own refusal
    gemma = read_gguf(target)
    wider = replace(gemma.kv["gemma4.embedding_length"], value=2 * int(gemma.get("gemma4.embedding_length")))
    gemma.kv["gemma4.embedding_length"] = wider
    width = check_projector(read_gguf(pair / PROJECTOR), gemma).result("projector.width")
    assert width is not None and width.status == "fail" and "mismatch between text model" in width.message
    alone = run_cli("dflash-verify", pair / PROJECTOR)
    assert alone.returncode == 1 and "Pass the target second" in alone.stdout


def test_publish_uploads_the_projector_and_says_how_to_serve_text_only(pair: Path) -> None:
    plan = plan_publish(pair, "someone/gemma-4-tiny-it-DFlash-GGUF", license="apache-2.0")
    files = {f.path_in_repo: f for f in plan.files}
    assert PROJECTOR in files and files[PROJECTOR].sha256 == sha256_file(pair / PROJECTOR)
    assert "--no-mmproj" in plan.card and f"`{PROJECTOR}`" in plan.card


@pytest.mark.reference
def test_the_projector_types_verify_knows_are_b11434s() -> None:
    """B11434_PROJECTOR_TYPES is clip-impl.h's PROJECTOR_TYPE_NAMES table, read from the b11434 source."""
    reference.require_or_skip(reference.llama_cpp_src_available())
    header = (llama_cpp_src() / "tools" / "mtmd" / "clip-impl.h").read_text(encoding="utf-8")
    table = header[header.index("PROJECTOR_TYPE_NAMES"):]
    table = table[:table.index("};")]
    assert set(re.findall(r'\{\s*PROJECTOR_TYPE_\w+,\s*"([^"]+)"\s*\}', table)) == B11434_PROJECTOR_TYPES
    REFERENCE_COMPARISONS.append("mmproj/b11434-projector-types")
