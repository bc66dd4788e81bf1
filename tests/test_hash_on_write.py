"""The sha256 the built-in writers compute while writing (for pair.json, so outputs are not read twice) is the
hash of the file's bytes: for a converted file (same-type tensors copied with copy_file_range, bytes that never
pass through Python), a one-pass converted-and-quantized file, a quantized file and a whole pipeline run."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import fixtures as mf
import pytest

from dflash_gguf.convert.targets import convert_target
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.ggufio.hashing import FollowingHasher
from dflash_gguf.quantize import quantize_gguf


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hash")
    return mf.make_drafter(root / "drafters", target="gemma4"), mf.make_gemma4_target(root / "targets")


def test_converted_target_and_drafter_hash(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    drafter, target = pair
    t = convert_target(target, tmp_path / "t.gguf")
    d = convert_drafter(drafter, target, tmp_path / "d.gguf", "bf16")
    assert t.sha256 == _sha(tmp_path / "t.gguf")
    assert d.sha256 == _sha(tmp_path / "d.gguf")


@pytest.mark.parametrize("quant", ["q4_0", "q8_0"])
def test_one_pass_and_builtin_quantizer_hash(tmp_path: Path, pair: tuple[Path, Path], quant: str) -> None:
    drafter, target = pair
    one = convert_target(target, tmp_path / "one.gguf", quant=quant)
    assert one.sha256 == _sha(tmp_path / "one.gguf")
    d_one = convert_drafter(drafter, target, tmp_path / "d-one.gguf", "bf16", quant=quant)
    assert d_one.sha256 == _sha(tmp_path / "d-one.gguf")
    convert_target(target, tmp_path / "mid.gguf")
    q = quantize_gguf(tmp_path / "mid.gguf", tmp_path / "q.gguf", quant, quantizer="builtin")
    assert q.sha256 == _sha(tmp_path / "q.gguf") == one.sha256


def test_dry_run_has_no_hash(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    drafter, target = pair
    assert convert_drafter(drafter, target, tmp_path / "d.gguf", "bf16", dry_run=True).sha256 is None
    assert not (tmp_path / "d.gguf").exists()


def test_following_hasher_on_a_growing_file(tmp_path: Path) -> None:
    """Bytes appended in uneven steps (and a hole left by a seek) hash as the finished file does."""
    path = tmp_path / "f.bin"
    with open(path, "wb", buffering=0) as f, FollowingHasher(path) as hasher:
        for i in range(1, 40):
            f.write(bytes([i]) * (i * 100_003))
            hasher.advance(f.tell())
        f.seek(5_000_000, 1)
        f.write(b"end")
        digest = hasher.finish(f.tell())
    assert digest == _sha(path)


def test_following_hasher_drops_what_it_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hasher asks the kernel to drop every byte it hashed from the page cache (nothing in a run reads the
    output again). The calls are recorded, not the cache's state: DONTNEED is advice, and the kernel keeps a
    page still dirty or under writeback when asked, as the writer's newest ones may be."""
    asked: list[tuple[int, int]] = []
    advise = os.posix_fadvise

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            asked.append((offset, offset + length))
        advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    path, mb = tmp_path / "f.bin", 1 << 20
    with open(path, "wb", buffering=0) as f, FollowingHasher(path) as hasher:
        for i in range(100):
            f.write(os.urandom(mb // 2 + i))
            hasher.advance(f.tell())
        size = f.tell()
        digest = hasher.finish(size)
    assert digest == _sha(path)
    end = 0
    for start, stop in sorted(asked):
        assert start <= end, f"bytes {end}..{start} were never dropped"
        end = max(end, stop)
    assert end == size and len(asked) >= size // (8 << 20)  # every byte, and as the hasher went, not once at the end
    assert all(stop - start <= 64 << 20 for start, stop in asked)


def test_pipeline_records_the_hash_it_computed_while_writing(tmp_path: Path, pair: tuple[Path, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """pair.json's sha256 of each built-in output is the file's, and the outputs are not read to get it."""
    from click.testing import CliRunner

    from dflash_gguf.cli import main
    from dflash_gguf.pipeline import manifest

    drafter, target = pair
    read: list[str] = []
    real = manifest.sha256_file

    def counting(path: Path) -> str:
        read.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(manifest, "sha256_file", counting)
    monkeypatch.delenv("LLAMA_QUANTIZE", raising=False)
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["convert", "--target", str(target), "--drafter", str(drafter), "--quant",
                                    "q4_0", "--outdir", str(out)])
    assert res.exit_code == 0, res.output
    outputs = json.loads((out / "pair.json").read_text())["outputs"]
    for side in ("target", "drafter"):
        rec = outputs[side]
        assert rec["sha256"] == _sha(out / rec["file"])
        assert rec["file"] not in read
