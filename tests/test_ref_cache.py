"""The reference-result cache cannot hide a difference: any changed input, argument, harness or build runs afresh.

The unit tests drive ``ref_cache.cached_run`` with a stand-in run that counts its calls; the reference tests
run b11434's converter and llama-quantize through ``tests/reference.py`` against a cache folder of their own,
so a result stored by an earlier session cannot make a miss look like a hit.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import conftest
import fixtures as mf
import preloaded_converter
import pytest
import ref_cache
import reference


class CountingRun:
    """A stand-in for a reference process: writes ``output`` from ``source``'s bytes and counts its calls."""

    def __init__(self, source: Path, output: Path) -> None:
        self.source, self.output, self.calls = source, output, 0

    def __call__(self) -> subprocess.CompletedProcess[str]:
        self.calls += 1
        self.output.write_bytes(b"converted:" + self.source.read_bytes())
        return subprocess.CompletedProcess([], 0, f"wrote {self.output} from {self.source}\n", "")


def _cached(tmp: Path, run: CountingRun, *, identity: str = "build-1", harness: str = "h1",
            args: tuple[str, ...] = ("bf16",)) -> ref_cache.Run:
    return ref_cache.cached_run("stand-in", root=tmp / "cache", identity=identity, harness=harness, args=list(args),
                                inputs={"src": run.source}, outputs={"out": run.output}, run=run)


@pytest.fixture
def stand_in(tmp_path: Path) -> CountingRun:
    src = tmp_path / "in" / "model.bin"
    src.parent.mkdir()
    src.write_bytes(b"\x00" * 64)
    return CountingRun(src, tmp_path / "out.gguf")


def test_same_inputs_reuse_the_output_and_text_at_the_callers_paths(tmp_path: Path, stand_in: CountingRun) -> None:
    first = _cached(tmp_path, stand_in)
    stand_in.output.unlink()
    moved = CountingRun(stand_in.source, tmp_path / "elsewhere" / "other-name.gguf")
    second = _cached(tmp_path, moved)
    assert (stand_in.calls, moved.calls) == (1, 0)
    assert (first.reused, second.reused) == (False, True)
    assert moved.output.read_bytes() == b"converted:" + b"\x00" * 64
    assert second.stdout == f"wrote {moved.output} from {stand_in.source}\n"


@pytest.mark.parametrize("change", ["input byte", "input name", "argument", "harness", "build"])
def test_any_change_misses(tmp_path: Path, stand_in: CountingRun, change: str) -> None:
    _cached(tmp_path, stand_in)
    kwargs: dict[str, object] = {}
    if change == "input byte":
        data = bytearray(stand_in.source.read_bytes())
        data[-1] ^= 1
        stand_in.source.write_bytes(bytes(data))
    elif change == "input name":
        stand_in.source = stand_in.source.rename(stand_in.source.with_name("renamed.bin"))
    else:
        kwargs = {"argument": {"args": ("q8_0",)}, "harness": {"harness": "h2"},
                  "build": {"identity": "build-2"}}[change]
    again = _cached(tmp_path, stand_in, **kwargs)  # type: ignore[arg-type]
    assert not again.reused and stand_in.calls == 2
    assert stand_in.output.read_bytes() == b"converted:" + stand_in.source.read_bytes()


def test_a_file_added_to_an_input_folder_misses(tmp_path: Path) -> None:
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    calls = []

    def run() -> subprocess.CompletedProcess[str]:
        calls.append(1)
        return subprocess.CompletedProcess([], 0, "", "")

    def cached() -> ref_cache.Run:
        return ref_cache.cached_run("stand-in", root=tmp_path / "cache", identity="b", harness="h", args=[],
                                    inputs={"repo": folder}, outputs={}, run=run)

    assert [cached().reused, cached().reused] == [False, True]
    (folder / "tokenizer.model").write_bytes(b"x")
    assert cached().reused is False and len(calls) == 2


def test_off_switch_runs_every_time(tmp_path: Path, stand_in: CountingRun, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ref_cache.CACHE_ENV, "off")
    assert [_cached(tmp_path, stand_in).reused for _ in range(2)] == [False, False]
    assert stand_in.calls == 2 and not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------------- with the real reference


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "ref-cache"
    monkeypatch.setattr(reference, "ref_cache_root", lambda: root)
    yield root


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.reference
def test_converter_input_changed_by_one_byte_runs_the_converter_again(tmp_path: Path, own_cache: Path) -> None:
    reference.require_or_skip(reference.reference_available())
    target = mf.make_gemma4_target(tmp_path / "targets")
    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    outputs = [tmp_path / f"ref-{i}.gguf" for i in range(3)]
    runs = []
    for i, out in enumerate(outputs):
        if i == 2:
            _flip_last_byte(drafter / "model.safetensors")  # the last byte of the last tensor's data
        runs.append(reference.run_reference_convert(drafter, target, out, "bf16"))
        assert runs[-1].returncode == 0, runs[-1].stderr
    stats = [run.stdout + run.stderr for run in runs]
    assert stats[1] == stats[0].replace(str(outputs[0]), str(outputs[1]))  # the text, at the caller's paths
    assert outputs[0].read_bytes() == outputs[1].read_bytes()
    assert outputs[2].read_bytes() != outputs[0].read_bytes()  # a fresh run: the changed weight is in its output
    entries = sorted((own_cache / "ref-results" / "reference converter").iterdir())
    assert len(entries) == 2  # one per distinct input
    conftest.REFERENCE_COMPARISONS.append("ref-cache: converter miss on a changed byte")


@pytest.mark.reference
def test_llama_quantize_input_changed_by_one_byte_runs_again(tmp_path: Path, own_cache: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    src = reference.write_tiny_llama_gguf(tmp_path / "tiny-F16.gguf")
    first = reference.run_llama_quantize(src, tmp_path / "a.gguf", "Q8_0")
    again = reference.run_llama_quantize(src, tmp_path / "b.gguf", "Q8_0")
    _flip_last_byte(src)  # the last block of output_norm or a weight: a different Q8_0 file
    changed = reference.run_llama_quantize(src, tmp_path / "c.gguf", "Q8_0")
    assert first.returncode == again.returncode == changed.returncode == 0, changed.stderr
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert (tmp_path / "c.gguf").read_bytes() != (tmp_path / "a.gguf").read_bytes()
    assert len(list((own_cache / "ref-results" / "llama-quantize").iterdir())) == 2
    conftest.REFERENCE_COMPARISONS.append("ref-cache: llama-quantize miss on a changed byte")


@pytest.mark.reference
@pytest.mark.parametrize("case", ["target", "drafter", "failure"])
def test_preloaded_converter_equals_a_fresh_process(tmp_path: Path, own_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                    case: str) -> None:
    """A conversion forked from the preloaded converter writes the same bytes, logs the same lines and exits with
    the same status as ``python convert_hf_to_gguf.py`` in a process of its own (the cache is off for both)."""
    reference.require_or_skip(reference.reference_available())
    monkeypatch.setenv(ref_cache.CACHE_ENV, "off")
    target = mf.make_gemma4_target(tmp_path / "targets")
    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    if case == "failure":
        (drafter / "config.json").write_text("{}")
    model, with_target = (target, None) if case == "target" else (drafter, target)
    runs = {}
    for mode in ("process", "preloaded"):
        monkeypatch.setenv(preloaded_converter.MODE_ENV, mode)
        out = tmp_path / mode / "out.gguf"
        out.parent.mkdir()
        runs[mode] = (reference.run_reference_convert(model, with_target, out, "bf16"), out)
    (fresh, fresh_out), (forked, forked_out) = runs["process"], runs["preloaded"]
    assert forked.returncode == fresh.returncode and (fresh.returncode == 0) == (case != "failure"), fresh.stderr
    if case == "failure":
        assert not fresh_out.exists() and not forked_out.exists()
        last_line = fresh.stderr.strip().splitlines()[-1]
        assert last_line and forked.stderr.strip().splitlines()[-1] == last_line
    else:
        assert forked_out.read_bytes() == fresh_out.read_bytes()
        assert forked.stdout == fresh.stdout.replace(str(fresh_out), str(forked_out))
        assert _log_lines(forked.stderr) == _log_lines(fresh.stderr.replace(str(fresh_out), str(forked_out)))
        assert len(_log_lines(fresh.stderr)) > 10
    conftest.REFERENCE_COMPARISONS.append(f"preloaded converter = a fresh process ({case})")


def _log_lines(stderr: str) -> list[str]:
    """The converter's logger lines (its progress bar, with a speed in it, differs run to run)."""
    return [line for line in stderr.splitlines() if line.split(":", 1)[0] in ("DEBUG", "INFO", "WARNING", "ERROR")]
