"""llama-quantize b11434's mixture rules (Q4_K_M, Q4_K_S, Q5_K_M, Q5_K_S, Q6_K, Q5_0, Q5_1, MXFP4_MOE): the type the
rules pick for every tensor is the type llama-quantize wrote, and the built-in's file is llama-quantize's, byte for
byte, on target layouts that reach each rule and on a drafter.

Layouts: Llama-style files with 256-wide rows (every K-quant fits) and 64-wide ones (Q4_K falls back to Q5_0, Q5_K to
Q5_1, Q6_K to Q8_0), untied and tied; grouped-query attention; an 8-expert model (its attention-K/V and output rules,
the layer read from the tensor name); an 80-layer GQA Llama (b11434's 70B type); the Qwen3.5 target our converter
writes (experts, and an MTP layer that counts in the block count); the Gemma-4 (tied embedding, per-layer KV
geometry) and Qwen3 fixture targets and a DFlash drafter as our converters write them (64-wide: the fallbacks).
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import fixtures as mf
import gguf_compare
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, use_kernels
from gguf import GGMLQuantizationType as Q

from dflash_gguf.convert.targets import convert_target
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.ggufio.reader import read_gguf
from dflash_gguf.quantize import quantize_gguf
from dflash_gguf.quantize.builtin import read_input
from dflash_gguf.quantize.rules import Mixture, ModelFacts, layer_sort_key

MIXTURES = ("q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q5_0", "q5_1", "mxfp4_moe", "iq4_xs", "iq4_nl", "q4_1")
COMPILED_ONLY = ("iq4_xs", "iq4_nl", "q4_1")  # no numpy kernels: without the compiled ones llama-quantize makes them


def _llama(path: Path, *, n_layer: int, n_embd: int, tied: bool = True, kv_heads: int = reference.TINY_HEADS,
           experts: int = 0) -> Path:
    rng = np.random.default_rng(n_layer * 1000 + n_embd)
    n_vocab = len(reference._tiny_vocab()[0])
    tensors = {"token_embd.weight": (rng.standard_normal((n_vocab, n_embd)) * 0.02).astype(np.float16),
               **reference._tiny_tensors(n_layer, n_embd, rng)}
    if not tied:
        tensors["output.weight"] = (rng.standard_normal((n_vocab, n_embd)) * 0.02).astype(np.float16)
    hparams = reference._tiny_hparams(n_layer, n_embd)
    hparams["attention.head_count_kv"] = ("uint32", kv_heads)
    if experts:
        hparams |= {"expert_count": ("uint32", experts), "expert_used_count": ("uint32", 2)}
    return reference._write_tiny(path, "llama", hparams, tensors, drop_tensors=(), extra_tensors=(), drop_keys=())


def _qwen35(path: Path) -> Path:
    target = mf.make_qwen35_target(path.parent / "qwen35-src", llama_cpp_src=reference.require_llama_cpp_src(),
                                   moe=True, mtp=True)
    convert_target(target, path, "bf16")
    return path


def _gemma4(path: Path) -> Path:
    convert_target(mf.make_gemma4_target(path.parent / "gemma4-src"), path, "bf16")
    return path


def _qwen3(path: Path) -> Path:
    target = mf.make_qwen3_target(path.parent / "qwen3-src", llama_cpp_src=reference.require_llama_cpp_src())
    convert_target(target, path, "bf16")
    return path


def _drafter(path: Path) -> Path:
    target = mf.make_gemma4_target(path.parent / "drafter-target")
    convert_drafter(mf.make_drafter(path.parent / "drafter-src", target="gemma4"), target, path, "bf16")
    return path


SOURCES = {
    "llama-256-untied-gqa": lambda p: _llama(p, n_layer=16, n_embd=256, tied=False, kv_heads=1),
    "llama-256-tied": lambda p: _llama(p, n_layer=12, n_embd=256),
    "llama-64-fallbacks": lambda p: _llama(p, n_layer=10, n_embd=64, tied=False),
    "llama-8-experts": lambda p: _llama(p, n_layer=8, n_embd=256, tied=False, experts=8),
    "qwen35-moe-mtp": _qwen35,
    "gemma4-tied": _gemma4,
    "qwen3-untied": _qwen3,
    "dflash-drafter": _drafter,
}


def _ours(src: Path, type_key: str) -> dict[str, str]:
    gguf = read_input(src)
    mixture = Mixture(ModelFacts.of(gguf.values, [t.name for t in gguf.tensors]), type_key)
    return {t.name: mixture.choose(t.name, t.ne, Q(t.qtype)).qtype.name
            for t in sorted(gguf.tensors, key=lambda t: layer_sort_key(t.name))}


def _written(path: Path) -> dict[str, str]:
    return {name: t.type_name for name, t in read_gguf(path).tensors.items()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("mixtures")
    return {name: make(work / f"{name}.gguf") for name, make in SOURCES.items()}


@pytest.mark.reference
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_the_builtin_writes_llama_quantizes_mixtures(sources: dict[str, Path], tmp_path: Path, source: str) -> None:
    """Every tensor at llama-quantize's type, and the whole file llama-quantize's bytes (our provenance keys
    aside), with the compiled kernels; the numpy kernels give the same bytes on the first layout."""
    reference.require_or_skip(reference.llama_cpp_available())
    src = sources[source]
    for type_key in MIXTURES:
        ref = tmp_path / f"ref-{type_key}.gguf"
        proc = reference.run_llama_quantize(src, ref, type_key.upper())
        assert proc.returncode == 0, proc.stderr[-3000:]
        written, ours = _written(ref), _ours(src, type_key)
        differ = {n: (ours[n], written[n]) for n in written if ours.get(n) != written[n]}
        assert not differ, (type_key, differ)
        paths = ("compiled", "numpy") if source == sorted(SOURCES)[0] and type_key not in COMPILED_ONLY else \
            ("compiled",)
        for path in paths:
            for _ in use_kernels(path):
                out = tmp_path / f"ours-{type_key}-{path}.gguf"
                quantize_gguf(src, out, type_key, quantizer="builtin")
                assert gguf_compare.diff(out, ref) == [], (type_key, path)
            REFERENCE_COMPARISONS.append(f"builtin {type_key} = llama-quantize, {source} [{path}]")


def _legacy_matrix(src: Path, path: Path) -> Path:
    """A legacy ``.dat`` importance matrix for every 2-D tensor of ``src`` (positive random values, one per column,
    times the experts), as llama-imatrix's save_imatrix_legacy writes it: with it, Q4_0's and Q5_0's rules put the
    first eighth of ffn_down at Q4_1 and Q5_1."""
    rng = np.random.default_rng(17)
    entries = [(name, rng.uniform(0.1, 4.0, t.ne[0] * (t.ne[2] if len(t.ne) > 2 else 1)).astype(np.float32))
               for name, t in read_gguf(src).tensors.items() if len(t.ne) >= 2]
    data = struct.pack("<i", len(entries))
    for name, values in entries:
        data += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 1, values.size) + values.tobytes()
    path.write_bytes(data + struct.pack("<i", 1) + struct.pack("<i", 9) + b"calib.txt")
    return path


@pytest.mark.reference
@pytest.mark.parametrize("type_key", ["q4_0", "q5_0"])
def test_q4_0_and_q5_0_with_a_matrix(sources: dict[str, Path], tmp_path: Path, type_key: str) -> None:
    """With an importance matrix, Q4_0 and Q5_0 take Q4_1 / Q5_1 for the first eighth of ffn_down (16 layers: two);
    the built-in's one pass (its compiled weighted kernels) writes llama-quantize --imatrix's bytes."""
    reference.require_or_skip(reference.llama_cpp_available())
    src = sources["llama-256-untied-gqa"]
    matrix = _legacy_matrix(src, tmp_path / "imatrix.dat")
    ref = tmp_path / "ref.gguf"
    proc = subprocess.run([str(reference.llama_bin("llama-quantize")), "--imatrix", matrix.name, str(src), str(ref),
                           type_key.upper(), "2"], cwd=tmp_path, capture_output=True, text=True,
                          env=reference._bin_env(), stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = _written(ref)
    assert {written[f"blk.{i}.ffn_down.weight"] for i in range(2)} == {"Q4_1" if type_key == "q4_0" else "Q5_1"}
    for _ in use_kernels("compiled"):
        out = tmp_path / "ours.gguf"
        quantize_gguf(src, out, type_key, quantizer="builtin", imatrix=matrix)
        assert gguf_compare.diff(out, ref) == [], type_key
    REFERENCE_COMPARISONS.append(f"builtin {type_key} --imatrix = llama-quantize --imatrix (Q4_1/Q5_1 ffn_down)")


@pytest.mark.reference
def test_the_70b_rule(tmp_path: Path) -> None:
    """An 80-layer Llama whose K/V heads are shared is b11434's LLM_TYPE_70B: Q4_K_M keeps every attention-V
    tensor the mixture would put at Q4_K at Q5_K instead. 80 layers of 256-wide blocks: one file, one type."""
    reference.require_or_skip(reference.llama_cpp_available())
    src = _llama(tmp_path / "llama-70b.gguf", n_layer=80, n_embd=256, tied=False, kv_heads=1)
    assert ModelFacts.of(read_input(src).values, []).is_70b
    ref = tmp_path / "ref.gguf"
    proc = reference.run_llama_quantize(src, ref, "Q4_K_M")
    assert proc.returncode == 0, proc.stderr[-3000:]
    written, ours = _written(ref), _ours(src, "q4_k_m")
    assert ours == written
    quantize_gguf(src, tmp_path / "ours.gguf", "q4_k_m", quantizer="builtin")
    assert gguf_compare.diff(tmp_path / "ours.gguf", ref) == []
    assert {written[f"blk.{i}.attn_v.weight"] for i in range(80)} == {"Q5_K", "Q6_K"}  # no Q4_K left
    REFERENCE_COMPARISONS.append("mixture q4_k_m llama-70b")
