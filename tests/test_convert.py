"""The drafter converter: parity with llama.cpp b11434, refusals with reasons, atomic output."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import fixtures as mf
import gguf
import gguf_compare
import numpy as np
import pytest
import reference
from click.testing import CliRunner, Result
from conftest import REFERENCE_COMPARISONS, run_cli
from gguf_compare import diff, read_kv

from dflash_gguf.cli import convert as cli_mod
from dflash_gguf.cli import main
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.errors import (
    ConfigError,
    IncompatiblePairError,
    InputError,
    OutputError,
    TensorError,
    TokenizerError,
    UnsupportedModelError,
)

# (target family, fixture variant, outtype) the reference converts correctly: compared byte for byte.
PARITY_CASES = [
    ("gemma4", "default", "auto"),
    ("qwen3", "default", "auto"),
    ("gemma4", "block_size_nested", "auto"),
    ("qwen3", "block_size_top", "auto"),
    ("qwen3", "rope_parameters", "auto"),
    ("gemma4", "rope_flat", "auto"),
    ("gemma4", "more_taps_than_layers", "auto"),
    ("qwen3", "no_readme_no_automap", "auto"),
    ("qwen3", "swa_layer_types", "auto"),
    ("gemma4", "is_causal_false", "auto"),
    ("gemma4", "embed_and_lm_head", "auto"),
    ("gemma4", "sliding_types_but_swa_off", "auto"),
    ("qwen3", "torch_dtype_old", "auto"),
    ("gemma4", "default", "f16"),
    ("gemma4", "default", "f32"),
    ("gemma4", "default", "q8_0"),
]


def _drafter(tmp_path: Path, target: str, variant: str, **kw: object) -> Path:
    return mf.make_drafter(tmp_path / "drafters", target=target, variant=variant, **kw)


def _convert_cli(drafter: Path, target: Path, out: Path, *extra: str) -> Result:
    """`dflash-gguf convert` in-process (click's CliRunner): exit code and the text a user sees."""
    return CliRunner().invoke(main, ["convert", "--drafter", str(drafter), "--target", str(target),
                                     "--outfile", str(out), *extra])


def _assert_nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} exists"
    assert not out.with_name(out.name + ".partial").exists(), f"{out}.partial exists"


@pytest.mark.reference
@pytest.mark.parametrize(("family", "variant", "outtype"), PARITY_CASES)
def test_matches_llama_cpp_b11434(tmp_path: Path, targets: dict[str, Path], family: str, variant: str,
                                  outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    target = targets[family]
    drafter = _drafter(tmp_path, family, variant)
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, target, ours, outtype)
    proc = reference.run_reference_convert(drafter, target, ref, outtype)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append(f"{family}/{variant}/{outtype}")


@pytest.mark.reference
def test_sharded_checkpoint_matches_reference(tmp_path: Path, targets: dict[str, Path]) -> None:
    reference.require_or_skip(reference.reference_available())
    drafter = mf.make_sharded(_drafter(tmp_path, "gemma4", "default"))
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, targets["gemma4"], ours)
    assert reference.run_reference_convert(drafter, targets["gemma4"], ref).returncode == 0
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append("gemma4/sharded/auto")


def test_contract_values_without_reference(tmp_path: Path, targets: dict[str, Path]) -> None:
    """The keys the b11434 loader needs, with the right types, checked directly (runs everywhere)."""
    out = tmp_path / "d.gguf"
    result = convert_drafter(_drafter(tmp_path, "gemma4", "default"), targets["gemma4"], out)
    kv = read_kv(out)
    assert kv["general.architecture"] == (["STRING"], "dflash")
    assert kv["dflash.target_layers"] == (["ARRAY", "INT32"], [2, 4])  # HF ids [1, 3] + 1
    assert kv["dflash.block_size"] == (["UINT32"], 16)
    assert kv["tokenizer.ggml.mask_token_id"] == (["UINT32"], 4)
    assert kv["dflash.embedding_scale"] == (["FLOAT32"], 8.0)  # sqrt(64) for a Gemma target
    assert kv["dflash.attention.sliding_window_pattern"] == (["ARRAY", "BOOL"], [True, False])
    assert kv["tokenizer.ggml.model"] == (["STRING"], "gemma4")
    tokens = kv["tokenizer.ggml.tokens"][1]
    assert tokens[105:107] == ["<|turn>", "<turn|>"] and len(tokens) == 512
    reader = gguf.GGUFReader(out)
    assert len(reader.tensors) == 11 * 2 + 3 == result.n_tensors
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_norm.weight"] == "F32" and types["fc.weight"] == "BF16"


# (variant, target family, exception, exit code, words the message must contain)
REFUSALS = [
    ("no_taps", "gemma4", ConfigError, 3, ["target_layer_ids", "target_layers"]),
    ("no_mask", "gemma4", ConfigError, 3, ["mask_token_id", "failed to add embedding"]),
    ("fc_width_wrong", "gemma4", IncompatiblePairError, 6, ["fc.weight", "wrong shape"]),
    ("hidden_mismatch", "gemma4", IncompatiblePairError, 6, ["hidden_size 96", "64"]),
    ("tap_out_of_range", "gemma4", IncompatiblePairError, 6, ["taps target layers [6]"]),
    ("tap_last_layer", "gemma4", IncompatiblePairError, 6, ["taps target layers [5]"]),
    ("missing_tensor", "gemma4", TensorError, 5, ["layers.1.mlp.down_proj.weight", "not found"]),
    ("unexpected_tensor", "gemma4", TensorError, 5, ["layers.0.self_attn.gate.weight", "wrong number of tensors"]),
    ("attention_bias", "gemma4", UnsupportedModelError, 4, ["attention_bias", "wrong number of tensors"]),
    ("d2t", "gemma4", UnsupportedModelError, 4, ["d2t", "DSpark"]),
    ("gelu", "gemma4", UnsupportedModelError, 4, ["hidden_act", "gelu", "SiLU"]),
    ("swa_without_layer_types", "gemma4", ConfigError, 3, ["layer_types", "sliding_window 32"]),
    ("wrong_arch", "gemma4", UnsupportedModelError, 4, ["architectures", "DFlashDraftModel"]),
]


@pytest.mark.parametrize(("variant", "family", "exc", "code", "words"), REFUSALS)
def test_refuses_bad_drafters(tmp_path: Path, targets: dict[str, Path], variant: str, family: str,
                              exc: type[Exception], code: int, words: list[str]) -> None:
    drafter = _drafter(tmp_path, family, variant)
    out = tmp_path / "out.gguf"
    with pytest.raises(exc) as err:
        convert_drafter(drafter, targets[family], out)
    for word in words:
        assert word in str(err.value)
    result = CliRunner().invoke(main, ["convert", "--drafter", str(drafter), "--target", str(targets[family]),
                                       "--outfile", str(out)])
    assert result.exit_code == code, result.output
    assert result.output.startswith("Error: ")
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


# (how the drafter is broken, exception, exit code, words the message must contain)
BAD_FILES = [
    ("no_config", ConfigError, 3, "config.json does not exist"),
    ("config_not_json", ConfigError, 3, "not valid JSON"),
    ("truncated", InputError, 2, "truncated"),
    ("header_json", InputError, 2, "corrupt safetensors header"),
    ("header_length", InputError, 2, "model.safetensors"),
]


def _break_drafter(d: Path, how: str) -> Path:
    if how == "no_config":
        (d / "config.json").unlink()
    elif how == "config_not_json":
        (d / "config.json").write_text("{not json")
    elif how == "truncated":
        mf.truncate_safetensors(d)
    else:
        mf.corrupt_safetensors_header(d, how=how.removeprefix("header_"))  # type: ignore[arg-type]
    return d


@pytest.mark.parametrize(("how", "exc", "code", "words"), BAD_FILES)
def test_refuses_bad_files(tmp_path: Path, targets: dict[str, Path], how: str, exc: type[Exception], code: int,
                           words: str) -> None:
    drafter = _break_drafter(_drafter(tmp_path, "gemma4", "default"), how)
    out = tmp_path / "out.gguf"
    with pytest.raises(exc, match=words):
        convert_drafter(drafter, targets["gemma4"], out)
    _assert_nothing_written(out)
    result = _convert_cli(drafter, targets["gemma4"], out)
    assert result.exit_code == code, result.output
    assert result.output.startswith("Error: ") and words in result.output
    _assert_nothing_written(out)


@pytest.mark.parametrize(("content", "words"), [(None, "no tokenizer.json"), ('{"model": ', "corrupt")])
def test_refuses_target_without_tokenizer(tmp_path: Path, content: str | None, words: str) -> None:
    target = mf.make_gemma4_target(tmp_path / "t")
    (target / "tokenizer.json").unlink()
    if content is not None:
        (target / "tokenizer.json").write_text(content)
    drafter, out = _drafter(tmp_path, "gemma4", "default"), tmp_path / "o.gguf"
    with pytest.raises(TokenizerError, match=words):
        convert_drafter(drafter, target, out)
    result = _convert_cli(drafter, target, out)
    assert result.exit_code == 7, result.output
    assert result.output.startswith("Error: ") and words in result.output
    _assert_nothing_written(out)


@pytest.mark.reference
def test_top_level_mask_is_fixed_and_recorded(tmp_path: Path, targets: dict[str, Path]) -> None:
    """b11434 (DFlashModel.set_vocab) ignores a top-level mask_token_id; we write it and say so in a note."""
    out = tmp_path / "d.gguf"
    drafter = _drafter(tmp_path, "qwen3", "mask_top_level_only")
    result = convert_drafter(drafter, targets["qwen3"], out)
    assert read_kv(out)["tokenizer.ggml.mask_token_id"] == (["UINT32"], 151669)
    [note] = [n for n in result.notes if "mask_token_id" in n]
    assert "top level" in note and "DFlashModel.set_vocab" in note and "abort" in note
    assert read_kv(out)["dflash_gguf.notes"][1] == list(result.notes)
    reference.require_or_skip(reference.reference_available())
    ref = tmp_path / "ref.gguf"
    assert reference.run_reference_convert(drafter, targets["qwen3"], ref).returncode == 0
    assert "tokenizer.ggml.mask_token_id" not in read_kv(ref)  # the defect we do not copy
    # Everything else is identical: only the mask id is added.
    assert diff(out, ref) == ["extra key tokenizer.ggml.mask_token_id (ours: (['UINT32'], 151669))"]
    REFERENCE_COMPARISONS.append("qwen3/mask_top_level_only (mask id added)")


@pytest.mark.reference
def test_block_size_absent_warns_and_notes(tmp_path: Path, targets: dict[str, Path]) -> None:
    """No block_size anywhere: 16 is written as b11434 writes it, with a warning on stderr and a note."""
    drafter = _drafter(tmp_path, "gemma4", "default", name="gemma4-no-block-size",
                       drop_config_keys=["dflash_config.block_size"])
    assert "block_size" not in (drafter / "config.json").read_text()
    out = tmp_path / "d.gguf"
    proc = run_cli("dflash-convert", "--drafter", drafter, "--target", targets["gemma4"], "--outfile", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" in proc.stderr and "block_size absent from config.json" in proc.stderr, proc.stderr
    assert "note: block_size absent from config.json: wrote 16" in proc.stdout, proc.stdout
    kv = read_kv(out)
    assert kv["dflash.block_size"] == (["UINT32"], 16)
    assert any(n.startswith("block_size absent") and "DFlashModel.set_gguf_parameters" in n
               for n in kv["dflash_gguf.notes"][1])
    reference.require_or_skip(reference.reference_available())
    ref = tmp_path / "ref.gguf"
    ref_proc = reference.run_reference_convert(drafter, targets["gemma4"], ref)
    assert ref_proc.returncode == 0, ref_proc.stderr[-3000:]
    assert diff(out, ref) == []  # b11434 writes the same 16, silently
    REFERENCE_COMPARISONS.append("gemma4/block_size_absent/auto")


def test_sliding_types_without_sliding_window_are_noted(tmp_path: Path, targets: dict[str, Path]) -> None:
    result = convert_drafter(_drafter(tmp_path, "gemma4", "sliding_types_but_swa_off"), targets["gemma4"],
                             tmp_path / "d.gguf")
    [note] = [n for n in result.notes if "sliding_attention" in n]
    assert "full attention" in note and "DFlashModel.set_gguf_parameters" in note


def test_notes_cite_nothing_outside_the_repository(tmp_path: Path, targets: dict[str, Path]) -> None:
    """Notes are written into user files: plain sentences, no labels of documents the user cannot see."""
    drafter = _drafter(tmp_path, "gemma4", "sliding_types_but_swa_off", name="all-notes",
                       config_overrides={"mask_token_id": 4}, drop_config_keys=["dflash_config.mask_token_id",
                                                                              "dflash_config.block_size"])
    notes = convert_drafter(drafter, targets["gemma4"], tmp_path / "d.gguf").notes
    assert len(notes) == 3
    for note in notes:
        assert not re.search(r"\b[CS]\d+\b|failure.mode|\.\./|shared/|issue", note), note


def test_failure_mid_write_leaves_nothing(tmp_path: Path, targets: dict[str, Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_gguf.drafters.dflash import convert as drafter_mod

    def broken_writer(src, qtype):  # noqa: ANN001, ANN202
        def write(out):  # noqa: ANN001, ANN202
            out.write(b"x" * 10)
            raise OSError(28, "No space left on device")
        return write

    monkeypatch.setattr(drafter_mod, "tensor_writer", broken_writer)
    drafter, out = _drafter(tmp_path, "gemma4", "default"), tmp_path / "d.gguf"
    with pytest.raises(OutputError, match="No space left on device"):
        convert_drafter(drafter, targets["gemma4"], out)
    assert list(tmp_path.glob("d.gguf*")) == []
    result = _convert_cli(drafter, targets["gemma4"], out)
    assert result.exit_code == 10, result.output
    assert result.output.startswith("Error: Writing ") and "No space left on device (errno 28)" in result.output
    assert list(tmp_path.glob("d.gguf*")) == []


def test_missing_output_folder(tmp_path: Path, targets: dict[str, Path]) -> None:
    out = tmp_path / "no" / "x.gguf"
    result = _convert_cli(_drafter(tmp_path, "gemma4", "default"), targets["gemma4"], out)
    assert result.exit_code == 10, result.output
    assert result.output.startswith("Error: Output folder ") and "does not exist" in result.output
    assert not out.parent.exists()


@contextlib.contextmanager
def _tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at `where` for the block (needs root; through the guard: skipped locally, fails on CI)."""
    where.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    if mount is None or os.geteuid() != 0:
        reason: str | None = f"mounting a tmpfs needs root and mount(8) (euid {os.geteuid()}, mount {mount})"
    else:
        proc = subprocess.run([mount, "-t", "tmpfs", "-o", options, "dflash-gguf-test", str(where)],
                              capture_output=True, text=True, timeout=30)
        reason = None if proc.returncode == 0 else f"mount -t tmpfs -o {options} failed: {proc.stderr.strip()}"
    reference.require_or_skip(reason)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True, timeout=30, check=False)


def test_refuses_when_free_space_is_short(tmp_path: Path, targets: dict[str, Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The free-space check runs on the output's folder, before anything is written (seam: disk_usage)."""
    from dflash_gguf import atomic

    asked: list[Path] = []
    real = shutil.disk_usage

    def small_disk(path: str | os.PathLike[str]) -> object:
        asked.append(Path(path))
        total, used, _ = real(path)
        return type(real(path))(total, used, 100_000)

    monkeypatch.setattr(atomic.shutil, "disk_usage", small_disk)
    out = tmp_path / "d.gguf"
    result = _convert_cli(_drafter(tmp_path, "gemma4", "default"), targets["gemma4"], out)
    assert result.exit_code == 10, result.output
    assert result.output.startswith(f"Error: Not enough disk space for {out}: about 0.2 MB is needed and "
                                    "0.1 MB is free"), result.output
    assert asked == [tmp_path]
    _assert_nothing_written(out)


def test_refuses_on_a_small_real_filesystem(tmp_path: Path, targets: dict[str, Path]) -> None:
    drafter = _drafter(tmp_path, "gemma4", "default")
    with _tmpfs(tmp_path / "small", "size=64k") as small:
        out = small / "d.gguf"
        result = _convert_cli(drafter, targets["gemma4"], out)
        assert result.exit_code == 10, result.output
        assert result.output.startswith(f"Error: Not enough disk space for {out}"), result.output
        assert "Free some space or choose another --outfile" in result.output
        assert list(small.iterdir()) == []


def test_read_only_output_folder(tmp_path: Path, targets: dict[str, Path]) -> None:
    drafter = _drafter(tmp_path, "gemma4", "default")
    if os.geteuid() == 0:  # root writes through permission bits: only a read-only mount stops it
        ctx: contextlib.AbstractContextManager[Path] = _tmpfs(tmp_path / "ro", "ro,size=4m")
        words = "Read-only file system (errno 30)"
    else:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        ctx, words = contextlib.nullcontext(tmp_path / "ro"), "Permission denied (errno 13)"
    with ctx as folder:
        out = folder / "d.gguf"
        result = _convert_cli(drafter, targets["gemma4"], out)
        assert result.exit_code == 10, result.output
        assert result.output.startswith("Error: Writing ") and words in result.output, result.output
        assert "Nothing was left under d.gguf" in result.output
        assert list(folder.iterdir()) == []


@pytest.mark.parametrize("outtype", ["auto", "f32"])  # byte copy, and read-convert-write
def test_checkpoint_shrinking_mid_read_is_an_input_error(tmp_path: Path, targets: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch, outtype: str) -> None:
    """The checkpoint passed every check, then is cut to its header while tensors are copied: exit 2."""
    drafter = _drafter(tmp_path, "gemma4", "default")
    weights = drafter / "model.safetensors"
    header_end = 8 + struct.unpack("<Q", weights.read_bytes()[:8])[0]

    class ShrinkAfterFirstTensor:  # stands in for the CLI's progress bar, called after each tensor
        def __init__(self, desc: str) -> None:
            self.calls = 0

        def __call__(self, done: int, total: int) -> None:
            self.calls += 1
            if self.calls == 1:
                os.truncate(weights, header_end)

        def close(self) -> None:
            pass

    monkeypatch.setattr(cli_mod, "Progress", ShrinkAfterFirstTensor)
    out = tmp_path / "d.gguf"
    result = _convert_cli(drafter, targets["gemma4"], out, "--outtype", outtype)
    assert weights.stat().st_size == header_end  # it did shrink
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"Error: {weights} changed while it was being read (tensor "), result.output
    assert "is cut short" in result.output
    _assert_nothing_written(out)


# Runs dflash-convert's entry point in a child whose tensor writer stops after the first tensor until
# the test interrupts it, so SIGINT lands mid-write every time, whatever the machine's speed.
_PAUSE_MID_WRITE = r"""
import pathlib, sys, time
from dflash_gguf.drafters.dflash import convert as drafter
ready = pathlib.Path(sys.argv[1])
real_writer = drafter.tensor_writer

def pausing_writer(src, qtype):
    write = real_writer(src, qtype)
    def write_then_wait(out):
        write(out)
        if not ready.exists():
            ready.write_text(str(out.tell()))
            time.sleep(120)
    return write_then_wait

drafter.tensor_writer = pausing_writer
from dflash_gguf.cli import convert_main
sys.argv = ["dflash-convert", *sys.argv[2:]]
convert_main()
"""


def test_ctrl_c_mid_write_exits_130_and_leaves_nothing(tmp_path: Path, targets: dict[str, Path]) -> None:
    drafter, out, ready = _drafter(tmp_path, "gemma4", "default"), tmp_path / "d.gguf", tmp_path / "ready"
    partial = out.with_name(out.name + ".partial")
    proc = subprocess.Popen([sys.executable, "-c", _PAUSE_MID_WRITE, str(ready), "--drafter", str(drafter),
                             "--target", str(targets["gemma4"]), "--outfile", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the converter never reached its first tensor"
            time.sleep(0.05)
        assert partial.stat().st_size > 0 and not out.exists()  # interrupted with a half-written .partial
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, stdout + stderr
    assert "Interrupted; no output was left behind." in stderr
    assert "Traceback" not in stderr
    _assert_nothing_written(out)


def test_never_runs_remote_code(tmp_path: Path, targets: dict[str, Path]) -> None:
    """The Qwen-style drafter ships dflash.py that raises on import; converting must not touch it."""
    drafter = _drafter(tmp_path, "qwen3", "default")
    assert (drafter / "dflash.py").is_file()
    convert_drafter(drafter, targets["qwen3"], tmp_path / "d.gguf")


def test_cli_json_and_dry_run(tmp_path: Path, targets: dict[str, Path]) -> None:
    drafter = _drafter(tmp_path, "gemma4", "default")
    out = tmp_path / "d.gguf"
    result = CliRunner().invoke(main, ["convert", "--drafter", str(drafter), "--target-model-dir",
                                       str(targets["gemma4"]), "--outfile", str(out), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["dry_run"] is True and doc["tensors"] == 25 and doc["vocab"]["tokens"] == 512
    assert not out.exists()


def _qwen3_target_with_sentencepiece(tmp_path: Path) -> Path:
    """A Qwen3-architecture target that ships a tokenizer.model: b11434 takes its SentencePiece path."""
    import shutil

    donor = mf.make_gemma3_target(tmp_path / "g3")
    target = tmp_path / "qwen3-sp"
    target.mkdir()
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(donor / name, target / name)
    (target / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "vocab_size": 512, "bos_token_id": 2, "eos_token_id": 1}))
    return target


@pytest.mark.reference
def test_sentencepiece_target_matches_reference(tmp_path: Path) -> None:
    target = _qwen3_target_with_sentencepiece(tmp_path)
    drafter = _drafter(tmp_path, "qwen3", "default",
                       config_overrides={"vocab_size": 600, "dflash_config.mask_token_id": 4})
    ours = tmp_path / "ours.gguf"
    result = convert_drafter(drafter, target, ours)
    kv = read_kv(ours)
    assert kv["tokenizer.ggml.model"] == (["STRING"], "llama") and result.vocab.n_tokens == 600
    assert kv["tokenizer.ggml.tokens"][1][599] == "[PAD599]"  # padded to the drafter's vocab_size
    reference.require_or_skip(reference.reference_available())
    ref = tmp_path / "ref.gguf"
    proc = reference.run_reference_convert(drafter, target, ref)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append("qwen3-sentencepiece/default/auto")


def test_cli_reads_tokenizer_overlay_and_records_origin(tmp_path: Path, targets: dict[str, Path]) -> None:
    from dflash_gguf.tokenizer_fixups import fix_tokenizer

    drafter = _drafter(tmp_path, "gemma4", "default")
    overlay = fix_tokenizer(targets["gemma4"], out=tmp_path / "overlay").overlay
    assert overlay is not None and (overlay / "tokenizer.model").is_file()
    direct, repaired = tmp_path / "direct.gguf", tmp_path / "repaired.gguf"
    convert_drafter(drafter, targets["gemma4"], direct)
    result = CliRunner().invoke(main, ["convert", "--drafter", str(drafter), "--target", str(targets["gemma4"]),
                                       "--tokenizer-dir", str(overlay), "--pair-with", "t.gguf",
                                       "--outfile", str(repaired)])
    assert result.exit_code == 0, result.output
    kv = read_kv(repaired)
    assert kv["dflash_gguf.tokenizer.origin"][1] == "synthesized"
    assert kv["dflash_gguf.target.file"][1] == "t.gguf"
    assert diff(repaired, direct) == []  # same vocabulary and tensors either way


# ------------------------------------------------------------------------- the parity comparison itself


def _tiny_gguf(path: Path, keys: list[tuple[str, str, object]],
               tensors: Sequence[str] = ("a.weight", "b.weight")) -> Path:
    """A minimal GGUF with (key, gguf-py add_* kind, value) in the given order and 4-float tensors."""
    writer = gguf.GGUFWriter(str(path), "dflash")
    for key, kind, value in keys:
        getattr(writer, f"add_{kind}")(key, value)
    for i, name in enumerate(tensors):
        writer.add_tensor(name, np.full(4, i, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_diff_checks_key_order_types_and_tensor_order(tmp_path: Path) -> None:
    base = [("dflash.block_count", "uint32", 2), ("dflash.block_size", "uint32", 16)]
    ref = _tiny_gguf(tmp_path / "ref.gguf", base)
    assert diff(_tiny_gguf(tmp_path / "same.gguf", base), ref) == []
    # Ignored keys may sit anywhere: they are removed before comparing order.
    noisy = [("general.license", "string", "mit"), base[0], ("dflash_gguf.converter", "string", "x"), base[1],
             ("general.base_model.count", "uint32", 1)]
    assert diff(_tiny_gguf(tmp_path / "noisy.gguf", noisy), ref) == []
    swapped = diff(_tiny_gguf(tmp_path / "swapped.gguf", base[::-1]), ref)
    assert swapped == ["key order differs from position 1: ours ['dflash.block_size', 'dflash.block_count'] vs "
                       "ref ['dflash.block_count', 'dflash.block_size']"]
    retyped = diff(_tiny_gguf(tmp_path / "int32.gguf", [base[0], ("dflash.block_size", "int32", 16)]), ref)
    assert retyped == ["key dflash.block_size: ours (['INT32'], 16) vs ref (['UINT32'], 16)"]
    assert diff(_tiny_gguf(tmp_path / "extra.gguf", [*base, ("general.url", "string", "u")]), ref) == \
        ["extra key general.url (ours: (['STRING'], 'u'))"]
    reordered = diff(_tiny_gguf(tmp_path / "t.gguf", base, ["b.weight", "a.weight"]), ref)
    assert "tensor order differs from position 0: ours ['b.weight', 'a.weight'] vs ref ['a.weight', 'b.weight']" \
        in reordered


def _readme_ignored_keys() -> tuple[set[str], set[str]]:
    """(exact keys, prefixes) in the first column of the README's 'Keys that differ by design' table."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    table = text.split("Keys that differ by design", 1)[1].split("\n\n", 2)[1]
    keys: set[str] = set()
    for row in table.splitlines()[2:]:
        keys |= set(re.findall(r"`([^`]+)`", row.split("|")[1]))
    return {k for k in keys if not k.endswith(".*")}, {k[:-1] for k in keys if k.endswith(".*")}


def test_ignored_keys_are_the_documented_ones() -> None:
    """gguf_compare ignores exactly the keys the README lists, each with its reason."""
    exact, prefixes = _readme_ignored_keys()
    assert exact == set(gguf_compare.IGNORED_KEYS)
    assert prefixes == set(gguf_compare.IGNORED_PREFIXES)
