"""Convert and quantize in one pass: the same bytes as converting to BF16 and then quantizing, no intermediate.

Two-step is checked both ways: with our built-in quantizer (always) and with real b11434 llama-quantize.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import fixtures as mf
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS

from dflash_gguf.drafters import convert_drafter
from dflash_gguf.quantize import quantize_gguf


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("onepass")
    return mf.make_drafter(root / "drafters", target="gemma4"), mf.make_gemma4_target(root / "targets")


def _to_f16_checkpoint(drafter: Path) -> None:
    """Rewrite the drafter's weights as F16: then no BF16 output tensor exists on disk and every quantized
    tensor goes through the spool path (widened and rounded to BF16 first, as the two-step file holds it)."""
    path = drafter / "model.safetensors"
    tensors = {}
    for name, dtype, shape, raw in mf.read_safetensors_raw(path):
        assert dtype == "BF16"
        tensors[name] = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    mf.write_safetensors(path, tensors, float_dtype="F16")


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".partial", ".spool")))


@pytest.mark.parametrize("quant", ["q4_0", "q8_0"])
@pytest.mark.parametrize("f16_checkpoint", [False, True])
def test_one_pass_equals_convert_then_builtin_quantize(tmp_path: Path, pair: tuple[Path, Path], quant: str,
                                                       f16_checkpoint: bool) -> None:
    drafter, target = pair
    if f16_checkpoint:
        drafter = mf.make_drafter(tmp_path / "d16", target="gemma4")
        _to_f16_checkpoint(drafter)
    out = tmp_path / "out"
    out.mkdir()
    outtype = "bf16"
    two_step = convert_drafter(drafter, target, tmp_path / "mid.gguf", outtype)
    quantize_gguf(two_step.outfile, tmp_path / "two.gguf", quant, quantizer="builtin")
    one = convert_drafter(drafter, target, out / "one.gguf", outtype, quant=quant)
    assert one.outtype == quant and one.n_bytes == (out / "one.gguf").stat().st_size
    assert (out / "one.gguf").read_bytes() == (tmp_path / "two.gguf").read_bytes()
    assert _leftovers(out) == []


def test_one_pass_dry_run_writes_nothing_and_sizes_the_output(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    drafter, target = pair
    dry = convert_drafter(drafter, target, tmp_path / "x.gguf", quant="q4_0", dry_run=True)
    real = convert_drafter(drafter, target, tmp_path / "y.gguf", quant="q4_0")
    assert dry.dry_run and not (tmp_path / "x.gguf").exists()
    assert dry.n_bytes == real.n_bytes == (tmp_path / "y.gguf").stat().st_size


@pytest.mark.reference
def test_one_pass_equals_convert_then_llama_quantize(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    drafter, target = pair
    mid = convert_drafter(drafter, target, tmp_path / "mid.gguf", "bf16").outfile
    proc = reference.run_llama_quantize(mid, tmp_path / "ref.gguf", "Q4_0")
    assert proc.returncode == 0, proc.stdout[-2000:]
    convert_drafter(drafter, target, tmp_path / "one.gguf", "bf16", quant="q4_0")
    import gguf_compare

    assert gguf_compare.diff(tmp_path / "one.gguf", tmp_path / "ref.gguf") == []
    REFERENCE_COMPARISONS.append("one-pass drafter q4_0 vs convert + llama-quantize")


def test_cli_quant_with_outfile_is_one_pass(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    """``dflash-convert --outfile X --quant q4_0`` writes the two-step bytes and nothing else."""
    from click.testing import CliRunner

    from dflash_gguf.cli import main

    drafter, target = pair
    out = tmp_path / "out"
    out.mkdir()
    res = CliRunner().invoke(main, ["convert", "--drafter", str(drafter), "--target", str(target),
                                    "--outfile", str(out / "d.gguf"), "--quant", "q4_0"])
    assert res.exit_code == 0, res.output
    assert "q4_0" in res.output
    two = convert_drafter(drafter, target, tmp_path / "mid.gguf", "bf16")
    quantize_gguf(two.outfile, tmp_path / "two.gguf", "q4_0", quantizer="builtin")
    assert (out / "d.gguf").read_bytes() == (tmp_path / "two.gguf").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == ["d.gguf"]


@pytest.mark.parametrize("family", ["gemma4", "qwen3"])
def test_target_one_pass_equals_convert_then_builtin_quantize(tmp_path: Path, targets: dict[str, Path],
                                                              family: str) -> None:
    """Targets too, through ``convert-target --quant``: Gemma-4's tied embedding and Qwen3's output take
    llama-quantize's output rule (Q8_0 here, as the fixture rows are not a multiple of 256)."""
    from click.testing import CliRunner

    from dflash_gguf.cli import main
    from dflash_gguf.convert.targets import convert_target

    out = tmp_path / "out"
    out.mkdir()
    res = CliRunner().invoke(main, ["convert-target", str(targets[family]), "--outfile", str(out / "t.gguf"),
                                    "--quant", "q4_0"])
    assert res.exit_code == 0, res.output
    convert_target(targets[family], tmp_path / "mid.gguf")
    quantize_gguf(tmp_path / "mid.gguf", tmp_path / "two.gguf", "q4_0", quantizer="builtin")
    assert (out / "t.gguf").read_bytes() == (tmp_path / "two.gguf").read_bytes()
    assert _leftovers(out) == [] and sorted(p.name for p in out.iterdir()) == ["t.gguf"]


@pytest.mark.reference
def test_llama_target_one_pass_spools_the_permuted_tensors(tmp_path: Path) -> None:
    """Llama's permuted q/k exist nowhere on disk: they are spooled one at a time and removed."""
    reference.require_or_skip(reference.llama_cpp_src_available())
    from dflash_gguf.convert.targets import convert_target

    target = mf.make_llama3_target(tmp_path / "t", llama_cpp_src=reference.env.llama_cpp_src(), tied=True)
    out = tmp_path / "out"
    out.mkdir()
    convert_target(target, out / "one.gguf", quant="q8_0")
    convert_target(target, tmp_path / "mid.gguf")
    quantize_gguf(tmp_path / "mid.gguf", tmp_path / "two.gguf", "q8_0", quantizer="builtin")
    assert (out / "one.gguf").read_bytes() == (tmp_path / "two.gguf").read_bytes()
    assert _leftovers(out) == [] and sorted(p.name for p in out.iterdir()) == ["one.gguf"]
    proc = reference.run_llama_quantize(tmp_path / "mid.gguf", tmp_path / "ref.gguf", "Q8_0")
    assert proc.returncode == 0, proc.stdout[-2000:]
    import gguf_compare

    assert gguf_compare.diff(out / "one.gguf", tmp_path / "ref.gguf") == []
    REFERENCE_COMPARISONS.append("one-pass llama target q8_0 vs convert + llama-quantize")


def test_a_released_scratch_name_is_never_given_to_a_tensor_still_read(tmp_path: Path) -> None:
    """Spooled tensors are read from scratch files while others are released: a new scratch file must not take the
    name (and so the open descriptor) of one still being read, which then reads another tensor's bytes."""
    from types import SimpleNamespace

    from dflash_gguf.quantize.builtin import InputTensor, _Sources

    def spooled(name: str, payload: bytes) -> InputTensor:
        return InputTensor(name, (len(payload),), 0, 0, len(payload), spool=lambda f: f.write(payload))

    sources = _Sources(SimpleNamespace(path=tmp_path / "in.gguf"), tmp_path)  # type: ignore[arg-type]
    a, b, c = spooled("a", b"A" * 8), spooled("b", b"B" * 8), spooled("c", b"C" * 8)
    sources.locate(a)
    fd_b, _ = sources.locate(b)
    sources.release(a)
    fd_c, _ = sources.locate(c)
    assert fd_b != fd_c
    assert os.pread(fd_b, 8, 0) == b"B" * 8 and os.pread(fd_c, 8, 0) == b"C" * 8
    sources.close()


def _bytes_read_from(monkeypatch: pytest.MonkeyPatch, folder: Path) -> dict[str, int]:
    """Counts the bytes ``os.pread``/``os.preadv`` return from the safetensors files in ``folder``."""
    prefix = f"{folder.resolve()}/"
    counted = {"bytes": 0}
    pread, preadv = os.pread, os.preadv
    lock = threading.Lock()  # the quantizer's workers read at once

    def count(fd: int, n: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.startswith(prefix) and name.endswith(".safetensors"):
            with lock:
                counted["bytes"] += n

    def counting_pread(fd: int, length: int, offset: int) -> bytes:
        data = pread(fd, length, offset)
        count(fd, len(data))
        return data

    def counting_preadv(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        n = preadv(fd, buffers, offset, *flags)
        count(fd, n)
        return n

    monkeypatch.setattr(os, "pread", counting_pread)
    monkeypatch.setattr(os, "preadv", counting_preadv)
    return counted


@pytest.mark.parametrize("family", ["gemma4", "qwen3"])
def test_several_tags_from_one_read_equal_one_run_each(tmp_path: Path, targets: dict[str, Path], family: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Three quant tags in one pass: each file is the bytes of a run of its own, and the checkpoint's weights are read
    once for the three (the bytes read equal a one-tag run's), not once per tag."""
    from dflash_gguf.convert.targets import convert_target

    tags = ["q4_k_m", "q6_k", "q8_0"]
    alone, together = tmp_path / "alone", tmp_path / "together"
    alone.mkdir()
    together.mkdir()
    counted = _bytes_read_from(monkeypatch, targets[family])
    reads = {}
    for tag in tags:
        counted["bytes"] = 0
        convert_target(targets[family], alone / f"t-{tag}.gguf", quant=tag, read_ahead=False)
        reads[tag] = counted["bytes"]
    counted["bytes"] = 0
    result = convert_target(targets[family], together / f"t-{tags[0]}.gguf", quant=tags[0], read_ahead=False,
                            more=[(together / f"t-{tag}.gguf", tag) for tag in tags[1:]])
    weights = sum(p.stat().st_size for p in targets[family].glob("*.safetensors"))
    assert 0 < counted["bytes"] == reads["q4_k_m"] <= weights, (counted, reads, weights)
    for tag in tags:
        assert (together / f"t-{tag}.gguf").read_bytes() == (alone / f"t-{tag}.gguf").read_bytes(), tag
    import hashlib

    assert [result.sha256, *result.more_sha256] == [
        hashlib.sha256((together / f"t-{tag}.gguf").read_bytes()).hexdigest() for tag in tags]
    assert _leftovers(together) == []
