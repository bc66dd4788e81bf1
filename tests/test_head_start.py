"""The one pass's head start: rows quantized before the writer gets there give the writer's own bytes.

Whether a head start has made any rows when the writer arrives depends on timing, so these tests decide it:
they let it finish, stop it after a given number of rows, or make it fail, and compare the output with one
written without any head start.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path

import fixtures as mf
import pytest

from dflash_gguf.convert.targets import convert_target, family_for, plan_tensors, working_ahead
from dflash_gguf.quantize import ahead
from dflash_gguf.quantize.builtin import ahead_jobs, read_input, run_builtin
from dflash_gguf.quantize.builtin import plan_tensors as quant_jobs


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mf.make_gemma4_target(tmp_path_factory.mktemp("head-start"))


@pytest.fixture(scope="module")
def bf16_gguf(tmp_path_factory: pytest.TempPathFactory, target: Path) -> Path:
    return convert_target(target, tmp_path_factory.mktemp("bf16") / "t-BF16.gguf").outfile


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, target: Path) -> bytes:
    """The one pass with no head start at all."""
    out = tmp_path_factory.mktemp("plain") / "t.gguf"
    convert_target(target, out, quant="q4_0", read_ahead=False)
    return out.read_bytes()


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_finished_head_start_is_copied_in_whole(tmp_path: Path, target: Path, plain: bytes) -> None:
    fam = family_for(target)
    specs = plan_tensors(fam)
    out = tmp_path / "t.gguf"
    with working_ahead(fam, specs, out, "auto", "q4_0") as head:
        assert isinstance(head, ahead.HeadStart)
        assert head.wait(60)
        made = head.rows_done
        assert made and all(rows > 0 for rows in made.values())  # every tensor it took on, made before the writer
        assert any(p.name.startswith(".t.gguf.ahead") for p in tmp_path.iterdir())
        result = convert_target(target, out, quant="q4_0", read_ahead=False)
        assert head.handed_over == made  # the writer took every row made ahead
    assert out.read_bytes() == plain
    assert result.sha256 == hashlib.sha256(plain).hexdigest()
    assert _names(tmp_path) == ["t.gguf"]  # the scratch files are gone


def _chunk(job: ahead.AheadJob) -> int:
    return max(1, job.rows // 5)


def _wrapped(jobs: list[ahead.AheadJob], convert: Callable[[ahead.AheadJob, int, int, int], object]
             ) -> list[ahead.AheadJob]:
    """The jobs in five chunks each, their chunks made by ``convert(original job, fd, first row, rows)``."""
    return [dataclasses.replace(job, rows_per_chunk=_chunk(job),
                                convert=lambda fd, row0, n, job=job: convert(job, fd, row0, n)) for job in jobs]


def _quantize(gguf_path: Path, out: Path, jobs: list[ahead.AheadJob] | None) -> str:
    gguf = read_input(gguf_path)
    if jobs is None:
        outcome = run_builtin(gguf, out, "q4_0")
    else:
        with ahead.HeadStart(jobs, out.parent, out.name) as head:
            head.wait(60)
            outcome = run_builtin(gguf, out, "q4_0")
    assert outcome.sha256 is not None
    return outcome.sha256


def test_rows_made_part_way_and_a_head_start_that_failed_give_the_same_bytes(tmp_path: Path,
                                                                              bf16_gguf: Path) -> None:
    """Stopped inside a tensor (after 2 of its chunks), or failing there, the head start hands over the rows it
    made and the writer makes the rest: the file is the file made without a head start, and nothing raises."""
    gguf = read_input(bf16_gguf)
    jobs = ahead_jobs(quant_jobs(gguf, "q4_0").jobs, bf16_gguf)
    assert len(jobs) >= 3
    expected = _quantize(bf16_gguf, tmp_path / "plain.gguf", None)
    first, second = jobs[0].key, jobs[1].key

    def stop_in_second(job: ahead.AheadJob, fd: int, row0: int, n: int) -> object:
        if job.key == second and row0 >= 2 * _chunk(job):
            raise RuntimeError("the head start breaks here")
        return job.convert(fd, row0, n)

    wrapped = _wrapped(jobs, stop_in_second)
    (tmp_path / "part").mkdir()
    with ahead.HeadStart(wrapped, tmp_path / "part", "t.gguf") as head:
        assert head.wait(60)
        made = head.rows_done
        run_builtin(gguf, tmp_path / "part" / "t.gguf", "q4_0")
        assert head.handed_over == {k: v for k, v in made.items() if v}
    assert made[first] == jobs[0].rows  # the first tensor whole
    assert made[second] == 2 * wrapped[1].rows_per_chunk < jobs[1].rows  # two chunks of the second
    assert (tmp_path / "part" / "t.gguf").read_bytes() == (tmp_path / "plain.gguf").read_bytes()
    assert _names(tmp_path / "part") == ["t.gguf"]
    assert hashlib.sha256((tmp_path / "part" / "t.gguf").read_bytes()).hexdigest() == expected


def test_a_head_start_is_stopped_by_the_writer_and_claims_only_its_own_tensors(tmp_path: Path,
                                                                                bf16_gguf: Path) -> None:
    gguf = read_input(bf16_gguf)
    jobs = ahead_jobs(quant_jobs(gguf, "q4_0").jobs, bf16_gguf)
    (tmp_path / "stale").mkdir()
    stale = tmp_path / "stale" / ".t.gguf.ahead0"
    stale.write_bytes(b"left by a run that was killed")
    with ahead.HeadStart(jobs[:1], tmp_path / "stale", "t.gguf") as head:
        assert head.wait(60)
        assert ahead.claim(("no", "such", "tensor")) is None
        claimed = ahead.claim(jobs[0].key)
        assert claimed is not None and claimed.rows == jobs[0].rows
        assert claimed.nbytes == jobs[0].rows * jobs[0].out_row_bytes == stale.stat().st_size
    assert ahead.claim(jobs[0].key) is None  # gone with its block
    assert _names(tmp_path / "stale") == []


def test_no_head_start_without_room_beside_the_output(tmp_path: Path, bf16_gguf: Path) -> None:
    gguf = read_input(bf16_gguf)
    jobs = ahead_jobs(quant_jobs(gguf, "q4_0").jobs, bf16_gguf)
    with ahead.HeadStart(jobs, tmp_path, "t.gguf", reserve=1 << 62) as head:
        assert head.wait(1) and head.rows_done == {}
        assert ahead.claim(jobs[0].key) is None
    assert _names(tmp_path) == []
