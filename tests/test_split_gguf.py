"""Split GGUFs (``<name>-0000k-of-0000n.gguf``), read and written as llama.cpp b11434 reads and writes them.

- Read by the first shard, as llama.cpp loads it (the first shard's metadata, every shard's tensors from its own
  file): the built-in quantizer's output from a split input equals ``llama-quantize`` on that first shard
  (``gguf_compare``: every byte but our own keys) and is byte for byte what the unsplit file quantizes to; verify
  judges it; a later shard or a missing one is refused with the fix.
- Written: our shards of a quantized file are ``llama-gguf-split --split``'s byte for byte (by tensor count and by
  size), those of an unquantized one are ``convert_hf_to_gguf.py --split-max-*``'s; the pipeline's
  ``--split-max-tensors`` target is recorded, verified, reused by a re-run, published and served by ``-hf``.
- The pipeline's ``--target-gguf REPO:FIRST-SHARD`` (every shard downloaded, linked and served beside a drafter-only
  repo) is proved in ``test_publish_private.py``.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import fixtures as mf
import gguf_compare
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli

from dflash_gguf.errors import InputError
from dflash_gguf.ggufio.reader import GGUFMeta, read_gguf, read_rows, split_siblings
from dflash_gguf.ggufio.split import SplitRule, parse_size
from dflash_gguf.ggufio.split import split_gguf as split_shards


def split_gguf(gguf: Path, prefix: Path, max_tensors: int) -> list[Path]:
    """b11434's ``llama-gguf-split --split --split-max-tensors N``; returns the shards in order."""
    proc = subprocess.run([str(reference.llama_bin("llama-gguf-split")), "--split", "--split-max-tensors",
                           str(max_tensors), str(gguf), str(prefix)], capture_output=True, text=True,
                          env=reference._bin_env(), stdin=subprocess.DEVNULL, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    shards = sorted(prefix.parent.glob(f"{prefix.name}-*-of-*.gguf"))
    assert len(shards) > 1 and split_siblings(shards[0]) == shards, shards
    return shards


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    reference.require_or_skip(reference.llama_cpp_available())
    root = tmp_path_factory.mktemp("split")
    target = mf.make_gemma4_target(root / "targets")
    whole = root / "gemma-4-tiny-it-BF16.gguf"
    made = run_cli("dflash-gguf", "convert-target", target, "--outfile", whole)
    assert made.returncode == 0, made.stdout + made.stderr
    (root / "shards").mkdir()
    return whole, split_gguf(whole, root / "shards" / "gemma-4-tiny-it-BF16", 7)


@pytest.mark.reference
def test_the_first_shard_reads_as_the_whole_file(split: tuple[Path, list[Path]]) -> None:
    whole, shards = split
    one, parts = read_gguf(whole), read_gguf(shards[0])
    assert parts.files == tuple(shards) and one.files == (whole,)
    def shapes(meta: GGUFMeta) -> dict[str, tuple[tuple[int, ...], int]]:
        return {n: (t.ne, t.qtype) for n, t in meta.tensors.items()}

    assert shapes(parts) == shapes(one)
    assert {t.shard for t in parts.tensors.values()} == set(range(len(shards)))
    last = max(parts.tensors.values(), key=lambda t: t.shard)  # a tensor of the last shard, read from its own file
    if len(last.ne) == 2:
        rows = [0, last.ne[1] - 1]
        assert np.array_equal(read_rows(parts, last.name, rows), read_rows(one, last.name, rows))
    assert {k for k in parts.kv if k.startswith("split.")} == {"split.no", "split.count", "split.tensors.count"}
    REFERENCE_COMPARISONS.append("llama-gguf-split/read by the first shard")


@pytest.mark.reference
def test_builtin_quantizes_a_split_file_as_llama_quantize_does(split: tuple[Path, list[Path]],
                                                               tmp_path: Path) -> None:
    whole, shards = split
    ours, from_whole = tmp_path / "ours-Q4_0.gguf", tmp_path / "whole-Q4_0.gguf"
    for src, out in ((shards[0], ours), (whole, from_whole)):
        made = run_cli("dflash-gguf", "quantize", src, out, "q4_0", "--quantizer", "builtin")
        assert made.returncode == 0, made.stdout + made.stderr
    ref = tmp_path / "ref-Q4_0.gguf"
    proc = subprocess.run([str(reference.llama_bin("llama-quantize")), str(shards[0]), str(ref), "Q4_0", "1"],
                          capture_output=True, text=True, env=reference._bin_env(), stdin=subprocess.DEVNULL,
                          timeout=300)  # not cached: the cache keys one input file, and this input is several
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert gguf_compare.diff(ours, ref) == []  # identical but for our own dflash_gguf.quantizer keys
    assert from_whole.read_bytes() == ours.read_bytes()  # split or whole: the same file (no split.* key kept)
    REFERENCE_COMPARISONS.append("builtin q4_0 of a split GGUF = llama-quantize")


@pytest.mark.reference
def test_a_split_target_is_judged_and_a_broken_split_refused(split: tuple[Path, list[Path]], tmp_path: Path) -> None:
    _, shards = split
    judged = run_cli("dflash-verify", shards[0], "--json")
    assert judged.returncode == 0, judged.stdout + judged.stderr
    with pytest.raises(InputError, match="Pass its first shard"):
        read_gguf(shards[1])
    partial = tmp_path / "partial"
    partial.mkdir()
    for shard in shards[:-1]:
        (partial / shard.name).symlink_to(shard)
    with pytest.raises(InputError, match=f"{shards[-1].name} is missing beside it"):
        read_gguf(partial / shards[0].name)
    later = run_cli("dflash-verify", shards[1])
    assert later.returncode == 2 and "first shard" in later.stdout + later.stderr
    REFERENCE_COMPARISONS.append("llama-gguf-split/verify and refusals")



def _synthetic(path: Path) -> Path:
    """A GGUF of ten F32 tensors of 400 kB and a few KVs (gguf-py's writer): large enough for llama-gguf-split's
    smallest size, 1M."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("split-me")
    rng = np.random.default_rng(7)
    for i in range(10):
        w.add_tensor(f"blk.{i}.w", rng.standard_normal((100, 1000)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_gguf_split(src: Path, prefix: Path, *args: str) -> list[Path]:
    proc = subprocess.run([str(reference.llama_bin("llama-gguf-split")), "--split", *args, str(src), str(prefix)],
                          capture_output=True, text=True, env=reference._bin_env(), stdin=subprocess.DEVNULL,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return sorted(prefix.parent.glob(f"{prefix.name}-*-of-*.gguf"))


@pytest.mark.reference
@pytest.mark.parametrize("case", ["tensors-7", "size-1M", "size-2M"])
def test_our_shards_are_llama_gguf_splits(split: tuple[Path, list[Path]], case: str, tmp_path: Path) -> None:
    """Our shards against b11434's ``llama-gguf-split --split``, byte for byte: by tensor count on the quantized
    target fixture, by size (its sizes are whole M or G) on a 4 MB file."""
    whole, _ = split
    (tmp_path / "ours").mkdir()
    (tmp_path / "ref").mkdir()
    if case == "tensors-7":
        src = tmp_path / "ours" / "t-Q4_0.gguf"
        made = run_cli("dflash-gguf", "quantize", whole, src, "q4_0", "--quantizer", "builtin")
        assert made.returncode == 0, made.stdout + made.stderr
        rule, args = SplitRule(max_tensors=7), ["--split-max-tensors", "7"]
    else:
        src = _synthetic(tmp_path / "ours" / "s-F32.gguf")
        size = case.removeprefix("size-")
        rule, args = SplitRule(max_bytes=parse_size(size)), ["--split-max-size", size]
    ours = [p for p, _ in split_shards(src, rule)]
    ref = _llama_gguf_split(src, tmp_path / "ref" / src.stem, *args)
    assert len(ours) > 1 and [p.name for p in ours] == [p.name for p in ref]
    for a, b in zip(ours, ref, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name
    assert not [p for p in src.parent.iterdir() if p.name.endswith(".partial")]
    REFERENCE_COMPARISONS.append(f"llama-gguf-split shards/{case}")


@pytest.mark.reference
def test_the_pipeline_splits_serves_and_publishes_the_target(tmp_path: Path) -> None:
    """``dflash-convert --split-max-tensors``: the target in shards equal to llama-gguf-split's of the unsplit
    target, recorded in pair.json, verified, reused by a re-run, published whole, served by b11434's
    ``llama-server -hf`` (every shard fetched, and the drafter drafting); publish refuses a file over
    ``--max-file-size`` naming --split-max-size."""
    reference.require_or_skip(reference.llama_cpp_available())
    import hub_server
    from test_publish_private import TOKEN, _publish
    from test_serve_layout import PROMPT, _server_env

    from dflash_gguf.errors import FileTooLargeRefused
    from dflash_gguf.llama_bin import FoundBinary
    from dflash_gguf.pipeline.manifest import read_manifest
    from dflash_gguf.tune.server import serve as run_llama_server

    fx = mf.make_acceptance_fixture(tmp_path / "fx")
    folder, whole = tmp_path / "out" / "qwen3-tiny-spm", tmp_path / "whole"
    for outdir, extra in ((folder, ["--split-max-tensors", "5"]), (whole, [])):
        made = run_cli("dflash-convert", "--target", fx.target, "--drafter", fx.drafter, "--outdir", outdir, *extra)
        assert made.returncode == 0, made.stdout + made.stderr
    record = read_manifest(folder / "pair.json")
    shards = sorted(folder.glob("qwen3-tiny-spm-Q4_0-*-of-*.gguf"))
    assert len(shards) > 1 and not (folder / "qwen3-tiny-spm-Q4_0.gguf").exists()
    assert record.target.file == shards[0].name and record.target.shards is not None
    assert [s.file for s in record.target.shards] == [p.name for p in shards[1:]]
    (tmp_path / "ref").mkdir()
    ref = _llama_gguf_split(whole / "qwen3-tiny-spm-Q4_0.gguf", tmp_path / "ref" / "qwen3-tiny-spm-Q4_0",
                            "--split-max-tensors", "5")
    assert [p.read_bytes() for p in shards] == [p.read_bytes() for p in ref]
    assert record.serve is not None and record.serve.command[2] == shards[0].name

    stamps = {p.name: p.stat().st_mtime_ns for p in shards}
    again = run_cli("dflash-convert", "--target", fx.target, "--drafter", fx.drafter, "--outdir", folder,
                    "--split-max-tensors", "5")
    assert again.returncode == 0, again.stdout + again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in shards} == stamps  # reused, not made again
    verified = run_cli("dflash-verify", folder / "pair.json", "--json")
    assert verified.returncode == 0 and f"manifest.target.{shards[-1].name}" in verified.stdout, verified.stdout

    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        refused = _publish(hub, tmp_path / "hf", folder, "me/split", "--license", "mit", "--max-file-size", "10K")
        assert hub.requests == []
        assert refused.returncode == FileTooLargeRefused.exit_code and "--split-max-size" in refused.stderr
        published = _publish(hub, tmp_path / "hf", folder, "me/split", "--license", "mit")
        assert published.returncode == 0, published.stdout + published.stderr
        files = dict(hub.repos["me/split"].files)
        assert {p.name for p in shards} <= set(files)
        hub.requests.clear()
        binary = FoundBinary(reference.llama_bin("llama-server"), "test")
        with run_llama_server(binary, ["-hf", "me/split", "--spec-type", "draft-dflash", "-t", "1", "-c", "1024"],
                              startup_timeout=180, env=_server_env(hub, tmp_path / "serve"),
                              workdir=tmp_path) as server:
            status, body = server.request("/completion", PROMPT, timeout=120)
        downloads = hub.downloads()
    assert status == 200 and isinstance(body, dict), (status, body, server.log()[-3000:])
    t = body["timings"]
    assert t["draft_n"] > 0 and t["draft_n_accepted"] / t["draft_n"] >= 0.9, t
    assert {p.name for p in shards} <= set(downloads), downloads
    REFERENCE_COMPARISONS.append("pipeline --split-max-tensors = llama-gguf-split; -hf serves the shards")


@pytest.mark.reference
@pytest.mark.parametrize("args", [("--split-max-tensors", "7"), ("--split-max-size", "100K")],
                         ids=["7-tensors", "100K"])
def test_unquantized_shards_are_the_converters(args: tuple[str, str], tmp_path: Path) -> None:
    """An unquantized target's shards as b11434's ``convert_hf_to_gguf.py --split-max-*`` writes them (its own
    grouping and key order), against that converter run on the same checkpoint."""
    reference.require_or_skip(reference.reference_available())
    from dflash_gguf.convert.targets import convert_target

    model = mf.make_gemma4_target(tmp_path / "targets")
    (tmp_path / "ours").mkdir()
    (tmp_path / "ref").mkdir()
    ours = tmp_path / "ours" / "t-BF16.gguf"
    convert_target(model, ours, "bf16")
    flag, value = args
    by_count = flag == "--split-max-tensors"
    rule = SplitRule(max_tensors=int(value)) if by_count else SplitRule(max_bytes=parse_size(value))
    shards = [p for p, _ in split_shards(ours, rule, converter=True)]
    with tempfile.TemporaryDirectory(prefix="dflash-ref-split-") as scratch:  # not cached: its outputs are shards
        proc = subprocess.run([str(reference.env.venv_python(reference.env.ref_venv_dir())),
                               str(reference.env.convert_script()), str(model), "--outfile",
                               str(tmp_path / "ref" / "t-BF16.gguf"), "--outtype", "bf16", flag, value],
                              cwd=scratch, env=reference._offline_env(Path(scratch)), capture_output=True, text=True,
                              timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = sorted((tmp_path / "ref").glob("t-BF16-*-of-*.gguf"))
    assert len(shards) > 1 and [p.name for p in shards] == [p.name for p in ref]
    for a, b in zip(shards, ref, strict=True):
        assert gguf_compare.diff(a, b) == [], a.name  # identical but for our own dflash_gguf.* keys
    REFERENCE_COMPARISONS.append(f"convert_hf_to_gguf {flag} {value} shards")


@pytest.mark.reference
def test_the_pipeline_splits_an_unquantized_target_as_the_converter(tmp_path: Path) -> None:
    """``--quant bf16 --split-max-tensors``: the pipeline's shards are the converter layout of its unsplit output."""
    reference.require_or_skip(reference.llama_cpp_available())
    fx = mf.make_acceptance_fixture(tmp_path / "fx")
    split, whole = tmp_path / "split", tmp_path / "whole"
    for outdir, extra in ((split, ["--split-max-tensors", "6"]), (whole, [])):
        made = run_cli("dflash-convert", "--target", fx.target, "--drafter", fx.drafter, "--quant", "bf16",
                       "--outdir", outdir, *extra)
        assert made.returncode == 0, made.stdout + made.stderr
    shards = sorted(split.glob("qwen3-tiny-spm-BF16-*-of-*.gguf"))
    (tmp_path / "again").mkdir()
    again = tmp_path / "again" / "qwen3-tiny-spm-BF16.gguf"
    again.write_bytes((whole / again.name).read_bytes())
    expected = [p for p, _ in split_shards(again, SplitRule(max_tensors=6), converter=True)]
    assert len(shards) > 1 and [p.read_bytes() for p in shards] == [p.read_bytes() for p in expected]
    REFERENCE_COMPARISONS.append("pipeline --quant bf16 --split-max-tensors = converter layout")


@pytest.mark.reference
def test_quantize_writes_shards(split: tuple[Path, list[Path]], tmp_path: Path) -> None:
    """``dflash-gguf quantize ... --split-max-tensors 7``: the shards llama-gguf-split makes of the unsplit output,
    and no unsplit file left."""
    whole, _ = split
    (tmp_path / "ours").mkdir()
    (tmp_path / "ref").mkdir()
    made = run_cli("dflash-gguf", "quantize", whole, tmp_path / "ours" / "t-Q4_0.gguf", "q4_0", "--quantizer",
                   "builtin", "--split-max-tensors", "7")
    assert made.returncode == 0 and "split into" in made.stdout, made.stdout + made.stderr
    single = tmp_path / "t-Q4_0.gguf"
    assert run_cli("dflash-gguf", "quantize", whole, single, "q4_0", "--quantizer", "builtin").returncode == 0
    ref = _llama_gguf_split(single, tmp_path / "ref" / "t-Q4_0", "--split-max-tensors", "7")
    ours = sorted((tmp_path / "ours").iterdir())
    assert [p.name for p in ours] == [p.name for p in ref]
    assert [p.read_bytes() for p in ours] == [p.read_bytes() for p in ref]
    REFERENCE_COMPARISONS.append("dflash-gguf quantize --split-max-tensors = llama-gguf-split")


def test_the_dry_run_names_the_shards(tmp_path: Path) -> None:
    """``dflash-convert --dry-run --split-max-size``: the plan names the target's first shard and about how many
    there will be (its estimated size over the limit); by tensor count it states the rule; the drafter is not
    split; ``--json`` carries the same."""
    import json

    fx = mf.make_acceptance_fixture(tmp_path / "fx")
    base = ["dflash-convert", "--target", fx.target, "--drafter", fx.drafter, "--outdir", tmp_path / "out",
            "--dry-run"]
    whole = json.loads(run_cli(*base, "--json").stdout)
    target = next(o for o in whole["plan"]["outputs"] if o["file"] == "qwen3-tiny-spm-Q4_0.gguf")
    limit = target["estimated_size"] // 3 + 1  # three shards of the estimate
    by_size = run_cli(*base, "--split-max-size", str(limit))
    assert by_size.returncode == 0, by_size.stdout + by_size.stderr
    assert "qwen3-tiny-spm-Q4_0-00001-of-00003.gguf" in by_size.stdout, by_size.stdout
    assert f"about 3 shards, at most {limit:,} bytes of tensors a shard" in by_size.stdout
    doc = json.loads(run_cli(*base, "--split-max-tensors", "5", "--json").stdout)
    split = {o["file"]: o.get("split") for o in doc["plan"]["outputs"]}
    assert split["qwen3-tiny-spm-Q4_0.gguf"] == "in shards, at most 5 tensors a shard"
    assert [f for f, s in split.items() if s] == ["qwen3-tiny-spm-Q4_0.gguf"]
