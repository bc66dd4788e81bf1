"""Importance matrices made and checked built in: ``--imatrix auto --calibration TEXT``.

- The pipeline's matrix is llama-imatrix's by hand on the same 16-bit file, text, context, chunks and threads (same
  tensors, same values, the text named by its file name only), and its Q4_K_M (the built-in's weighted kernels) and
  IQ4_XS (llama-quantize) are llama-quantize ``--imatrix`` of that file by hand; a second run reuses them all.
- ``--imatrix FILE`` with the built-in quantizer is one pass from safetensors: Q4_K_M, Q5_K_M, Q6_K, Q5_1, Q4_0 and
  IQ4_XS (five of them from one read) equal llama-quantize ``--imatrix`` of the BF16 conversion on the tied dense,
  untied dense and MoE fixtures.
- A matrix of another model is refused (exit 24) by ``dflash-gguf quantize`` and the pipeline, before llama-quantize
  would quietly quantize without it; the legacy ``.dat`` format is read as well as the GGUF one.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import fixtures as mf
import gguf_compare
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli

from dflash_gguf.errors import ImatrixMismatch, InputError
from dflash_gguf.ggufio.reader import read_gguf
from dflash_gguf.quantize.imatrix import check_imatrix, read_imatrix

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 120
CALIBRATION = ["--calibration-ctx", "64", "--calibration-chunks", "2"]
THREADS = max(1, min(os.cpu_count() or 1, 8))  # the pipeline's default --threads, which it gives llama-imatrix


def _tools_env() -> dict[str, str]:
    return {"LLAMA_QUANTIZE": str(reference.llama_bin("llama-quantize")),
            "LLAMA_IMATRIX": str(reference.llama_bin("llama-imatrix"))}


def _by_hand(model: Path, text: Path, out: Path, *extra: str) -> Path:
    """b11434's llama-imatrix as a user runs it: in the text's folder, the text by name."""
    cmd = [str(reference.llama_bin("llama-imatrix")), "-m", str(model), "-f", text.name, "-o", str(out), "-c", "64",
           "--chunks", "2", "-t", str(THREADS), "--no-ppl", *extra]
    proc = subprocess.run(cmd, cwd=text.parent, capture_output=True, text=True, env=reference._bin_env(),
                          stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def _tensors(path: Path) -> dict[str, np.ndarray]:
    from gguf import GGUFReader

    return {t.name: np.array(t.data) for t in GGUFReader(path).tensors}


def _gemma4_pair_and_text(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The Gemma-4 fixture target and its drafter, and the calibration text as ``calibration/calib.txt``."""
    text = tmp_path / "calibration" / "calib.txt"
    text.parent.mkdir()
    text.write_text(TEXT)
    return mf.make_gemma4_target(tmp_path / "targets"), mf.make_drafter(tmp_path / "drafters", target="gemma4"), text


@pytest.mark.reference
def test_imatrix_auto_is_llama_imatrix_by_hand(tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    target, drafter, text = _gemma4_pair_and_text(tmp_path)
    folder = tmp_path / "pair"
    args = ["dflash-convert", "--target", target, "--drafter", drafter, "--quant", "Q4_K_M,IQ4_XS", "--imatrix",
            "auto", "--calibration", text, *CALIBRATION, "--keep-intermediate", "--outdir", folder]
    made = run_cli(*args, env=_tools_env())
    assert made.returncode == 0, made.stdout + made.stderr
    ours = folder / "imatrix" / "imatrix-gemma-4-tiny-it.gguf"
    bf16 = folder / "gemma-4-tiny-it-BF16.gguf"
    hand = _by_hand(bf16, text, tmp_path / "hand.gguf")
    mine, theirs = _tensors(ours), _tensors(hand)
    assert sorted(mine) == sorted(theirs) and len(mine) > 10
    for name in mine:
        assert np.array_equal(mine[name], theirs[name], equal_nan=True), name
    meta = read_gguf(ours)
    assert list(meta.get("imatrix.datasets")) == ["calib.txt"] and meta.get("imatrix.chunk_size") == 64
    doc = json.loads((folder / "pair.json").read_text())
    assert doc["outputs"]["imatrix"]["file"] == "imatrix/imatrix-gemma-4-tiny-it.gguf"
    assert "2 chunks of 64 tokens on calib.txt" in doc["outputs"]["imatrix"]["made_by"]
    assert doc["stages"]["imatrix"]["key"]["text"]["name"] == "calib.txt"
    for tag in ("Q4_K_M", "IQ4_XS"):  # llama-quantize --imatrix of the same file, given by name as we do
        cmd = [str(reference.llama_bin("llama-quantize")), "--imatrix", ours.name, str(bf16),
               str(tmp_path / f"hand-{tag}.gguf"), tag, str(THREADS)]
        proc = subprocess.run(cmd, cwd=ours.parent, capture_output=True, text=True, env=reference._bin_env(),
                              stdin=subprocess.DEVNULL, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert gguf_compare.diff(folder / f"gemma-4-tiny-it-{tag}.gguf", tmp_path / f"hand-{tag}.gguf") == [], tag
    stamps = {p: p.stat().st_mtime_ns for p in [ours, *folder.glob("*.gguf")]}
    again = run_cli(*args, env=_tools_env())
    assert again.returncode == 0 and {p: p.stat().st_mtime_ns for p in stamps} == stamps  # the cache is reused
    REFERENCE_COMPARISONS.append("--imatrix auto = llama-imatrix by hand; its Q4_K_M/IQ4_XS = llama-quantize")


@pytest.mark.reference
@pytest.mark.parametrize("family", ["gemma4-tied", "qwen3-untied", "qwen3moe"])
def test_one_pass_with_an_imatrix_is_llama_quantize_imatrix(tmp_path: Path, family: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    from dflash_gguf.convert.targets import convert_target
    from dflash_gguf.quantize.imatrix import load_importance

    if family == "gemma4-tied":
        model = mf.make_gemma4_target(tmp_path / "targets")
    elif family == "qwen3-untied":
        model = mf.make_acceptance_fixture(tmp_path / "fx").target
    else:
        reference.require_or_skip(reference.llama_cpp_src_available())
        model = mf.make_qwen3moe_target(tmp_path / "targets", llama_cpp_src=reference.env.llama_cpp_src())
    text = tmp_path / "calibration" / "calib.txt"
    text.parent.mkdir()
    text.write_text(TEXT)
    bf16 = tmp_path / "model-BF16.gguf"
    convert_target(model, bf16)
    (tmp_path / "imatrix").mkdir()
    matrix = _by_hand(bf16, text, tmp_path / "imatrix" / "imatrix-model.gguf")
    tags = ["q4_k_m", "q5_k_m", "q6_k", "q5_1", "q4_0", "iq4_xs"]
    out = tmp_path / "ours"
    out.mkdir()
    importance = load_importance(matrix)
    convert_target(model, out / "t-q4_k_m.gguf", quant="q4_k_m", importance=importance)  # one tag
    convert_target(model, out / "t-q5_k_m.gguf", quant="q5_k_m", importance=importance,  # three from one read
                   more=[(out / f"t-{t}.gguf", t) for t in tags[2:]])
    for tag in tags:
        cmd = [str(reference.llama_bin("llama-quantize")), "--imatrix", matrix.name, str(bf16),
               str(tmp_path / f"hand-{tag}.gguf"), tag.upper(), "2"]
        proc = subprocess.run(cmd, cwd=matrix.parent, capture_output=True, text=True, env=reference._bin_env(),
                              stdin=subprocess.DEVNULL, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert gguf_compare.diff(out / f"t-{tag}.gguf", tmp_path / f"hand-{tag}.gguf") == [], (family, tag)
    REFERENCE_COMPARISONS.append(f"one-pass --imatrix {family} = llama-quantize --imatrix")


@pytest.mark.reference
def test_a_matrix_of_another_model_is_refused(tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    gemma = mf.make_gemma4_target(tmp_path / "targets")
    fx = mf.make_acceptance_fixture(tmp_path / "fx")
    for name, folder in (("gemma", gemma), ("qwen3", fx.target)):
        made = run_cli("dflash-gguf", "convert-target", folder, "--outfile", tmp_path / f"{name}-BF16.gguf")
        assert made.returncode == 0, made.stdout + made.stderr
    other = _by_hand(tmp_path / "qwen3-BF16.gguf", text, tmp_path / "imatrix-qwen3.gguf")
    own_dat = _by_hand(tmp_path / "gemma-BF16.gguf", text, tmp_path / "imatrix-gemma.dat", "--output-format", "dat")
    own_gguf = _by_hand(tmp_path / "gemma-BF16.gguf", text, tmp_path / "imatrix-gemma.gguf")
    assert read_imatrix(own_dat) == read_imatrix(own_gguf) and read_imatrix(own_dat)  # both formats, same entries
    check_imatrix(own_dat, tmp_path / "gemma-BF16.gguf")
    with pytest.raises(ImatrixMismatch, match="belongs to another model"):
        check_imatrix(other, tmp_path / "gemma-BF16.gguf")

    quantize = run_cli("dflash-gguf", "quantize", tmp_path / "gemma-BF16.gguf", tmp_path / "out.gguf", "Q4_K_M",
                       "--imatrix", other, env=_tools_env())
    assert quantize.returncode == 24 and "belongs to another model" in quantize.stderr, quantize.stderr
    assert not (tmp_path / "out.gguf").exists()
    ok = run_cli("dflash-gguf", "quantize", tmp_path / "gemma-BF16.gguf", tmp_path / "out.gguf", "Q4_K_M",
                 "--imatrix", own_dat, env=_tools_env())
    assert ok.returncode == 0, ok.stderr
    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    pipeline = run_cli("dflash-convert", "--target", gemma, "--drafter", drafter, "--quant", "Q4_K_M", "--imatrix",
                       other, "--outdir", tmp_path / "pair", env=_tools_env())
    assert pipeline.returncode == 24 and "belongs to another model" in pipeline.stderr, pipeline.stderr
    REFERENCE_COMPARISONS.append("another model's imatrix refused; legacy .dat read as llama-imatrix writes it")


def test_unreadable_matrices_and_flags_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.dat"
    bad.write_bytes(b"\x05\x00\x00\x00garbage")
    with pytest.raises(InputError, match="neither llama-imatrix's GGUF format nor its legacy .dat"):
        read_imatrix(bad)
    entries = [("blk.0.ffn_up.weight", [1.0] * 64), ("output.weight", [2.0] * 64)]
    dat = struct.pack("<i", len(entries)) + b"".join(
        struct.pack("<i", len(n)) + n.encode() + struct.pack("<ii", 1, len(v)) + struct.pack(f"<{len(v)}f", *v)
        for n, v in entries) + struct.pack("<i", 2) + struct.pack("<i", 9) + b"calib.txt"
    (tmp_path / "m.dat").write_bytes(dat)
    assert read_imatrix(tmp_path / "m.dat") == {"blk.0.ffn_up.weight": 64, "output.weight": 64}
    target = mf.make_gemma4_target(tmp_path / "targets")
    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    for args, message in ((["--calibration", "x.txt"], "add --imatrix auto"),
                          (["--imatrix", "auto"], "needs --calibration")):
        proc = run_cli("dflash-convert", "--target", target, "--drafter", drafter, *args, "--outdir", tmp_path / "o")
        assert proc.returncode == 2 and message in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.reference
def test_imatrix_auto_is_made_once_for_any_folder(tmp_path: Path) -> None:
    """A second --imatrix auto run on the same target and text into a fresh folder runs no llama-imatrix: the matrix
    is taken from the content cache, byte for byte, and so are the quants made with it; another text makes it again."""
    reference.require_or_skip(reference.llama_cpp_available())
    target, drafter, text = _gemma4_pair_and_text(tmp_path)
    counting, calls, lib = reference.noting_binary(tmp_path, "llama-imatrix")
    env = {**_tools_env(), "LLAMA_IMATRIX": str(counting), **lib}
    runs = lambda: len(calls.read_text().splitlines())  # noqa: E731

    def run(folder: Path, quant: str) -> Path:
        made = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--quant", quant, "--imatrix",
                       "auto", "--calibration", text, *CALIBRATION, "--outdir", folder, env=env)
        assert made.returncode == 0, made.stdout + made.stderr
        return folder / "imatrix" / "imatrix-gemma-4-tiny-it.gguf"

    first = run(tmp_path / "first", "Q4_K_M")
    assert runs() == 1
    second = run(tmp_path / "second", "Q4_K_M,IQ4_XS")
    assert runs() == 1  # no llama-imatrix: the matrix made for "first" was taken
    assert second.read_bytes() == first.read_bytes()
    assert gguf_compare.diff(tmp_path / "first" / "gemma-4-tiny-it-Q4_K_M.gguf",
                             tmp_path / "second" / "gemma-4-tiny-it-Q4_K_M.gguf") == []
    text.write_text(TEXT.replace("fox", "wolf"))  # another text: made again
    third = run(tmp_path / "third", "Q4_K_M")
    assert runs() == 2 and third.read_bytes() != first.read_bytes()
    REFERENCE_COMPARISONS.append("--imatrix auto made once per target and text, any folder")
