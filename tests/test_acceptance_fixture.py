"""The constructed-weights pair (fixtures/acceptance.py): the targets' greedy tokens are what the construction
says, offline in numpy, and llama.cpp b11434's llama-server accepts ~every draft of the matched pair and ~none
with the perturbed target."""

from __future__ import annotations

from pathlib import Path

import fixtures as mf
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS
from fixtures.acceptance import AcceptanceFixture

from dflash_gguf.convert.targets import convert_target
from dflash_gguf.drafters import convert_drafter


def _load(path: Path) -> dict[str, np.ndarray]:
    """model.safetensors as float32 (the fixtures store BF16: widen by shifting into the high half)."""
    out = {}
    for name, dtype, shape, raw in mf.read_safetensors_raw(path):
        assert dtype == "BF16", (name, dtype)
        out[name] = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return out


def _rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _block(x: np.ndarray, t: dict[str, np.ndarray], p: str, n_heads: int, n_kv: int) -> np.ndarray:
    """One Qwen3 block at a single position (attention over one token returns its own value vector)."""
    h = _rms(x, t[f"{p}.input_layernorm.weight"])
    v = h @ t[f"{p}.self_attn.v_proj.weight"].T  # [N, n_kv * hd]
    hd = v.shape[1] // n_kv
    attn = np.repeat(v.reshape(len(x), n_kv, hd), n_heads // n_kv, axis=1).reshape(len(x), n_heads * hd)
    x = x + attn @ t[f"{p}.self_attn.o_proj.weight"].T
    h = _rms(x, t[f"{p}.post_attention_layernorm.weight"])
    ff = _silu(h @ t[f"{p}.mlp.gate_proj.weight"].T) * (h @ t[f"{p}.mlp.up_proj.weight"].T)
    return x + ff @ t[f"{p}.mlp.down_proj.weight"].T


def _target_logits(target_dir: Path) -> np.ndarray:
    """Logits for every vocab token fed alone: embedding -> blocks -> final norm -> lm_head."""
    t = _load(target_dir / "model.safetensors")
    x = t["model.embed_tokens.weight"].copy()
    for i in range(mf.SIZES["target_layers"]):
        x = _block(x, t, f"model.layers.{i}", mf.SIZES["heads"], mf.SIZES["kv_heads"])
    return _rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_construction_is_deterministic_and_fixes_the_greedy_tokens(tmp_path: Path) -> None:
    a = mf.make_acceptance_fixture(tmp_path / "a")
    b = mf.make_acceptance_fixture(tmp_path / "b")
    assert isinstance(a, AcceptanceFixture) and (b.token_c, b.token_d) == (a.token_c, a.token_d)
    assert {p.name for p in (a.target, a.perturbed_target, a.drafter)} == {
        "qwen3-tiny-spm", "qwen3-tiny-spm-retrained", "qwen3-tiny-spm-DFlash"}
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert (a.target / "tokenizer.model").is_file() and not (a.target / "tokenizer.json").exists()

    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(a.target / "tokenizer.model"))
    assert sp.vocab_size() == 512
    for tok in (a.token_c, a.token_d):  # plain text pieces: nothing llama.cpp could take for end of generation
        assert not (sp.IsControl(tok) or sp.IsUnknown(tok) or sp.IsByte(tok) or sp.IsUnused(tok)), sp.IdToPiece(tok)
        assert tok not in (sp.eos_id(), sp.bos_id(), sp.pad_id())
    assert a.token_c != a.token_d

    logits = _target_logits(a.target)
    assert (logits.argmax(axis=1) == a.token_c).all()  # whatever the input token
    margin = logits[:, a.token_c] - np.delete(logits, a.token_c, axis=1).max(axis=1)
    assert margin.min() > 10, margin.min()
    perturbed = _target_logits(a.perturbed_target)
    assert (perturbed.argmax(axis=1) == a.token_d).all()
    assert (perturbed[:, a.token_d] - perturbed[:, a.token_c]).min() > 10

    # The drafter adds nothing to its residual, so its head (the target's) reads the target's embeddings: C.
    d = _load(a.drafter / "model.safetensors")
    assert all((d[n] == 0).all() for n in d if n.endswith(("o_proj.weight", "down_proj.weight")))
    assert all((d[n] == 1).all() for n in d if "norm" in n)
    t = _load(a.target / "model.safetensors")
    x = t["model.embed_tokens.weight"].copy()
    for i in range(mf.SIZES["drafter_layers"]):
        x = _block(x, d, f"layers.{i}", mf.SIZES["heads"], mf.SIZES["kv_heads"])
    drafted = (_rms(x, d["norm.weight"]) @ t["lm_head.weight"].T).argmax(axis=1)
    assert (drafted == a.token_c).all()


def _serve(target_gguf: Path, drafter_gguf: Path, n_predict: int = 32) -> dict:
    with reference.start_llama_server(target_gguf, drafter_gguf, n_max=15, extra_args=["-t", "1", "-c", "512"]) as s:
        assert s.ready, s.output[-3000:]
        status, body = reference.http_json(s.url + "/completion", {"prompt": "hello", "n_predict": n_predict,
                                                                   "temperature": 0, "ignore_eos": True})
        assert status == 200, body
    assert isinstance(body, dict)
    return body


@pytest.mark.reference
def test_llama_server_accepts_the_matched_drafts_and_rejects_the_perturbed(tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    fx = mf.make_acceptance_fixture(tmp_path / "fx")
    target, perturbed, drafter = tmp_path / "target.gguf", tmp_path / "perturbed.gguf", tmp_path / "drafter.gguf"
    convert_target(fx.target, target)
    convert_target(fx.perturbed_target, perturbed)
    convert_drafter(fx.drafter, fx.target, drafter)
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(fx.target / "tokenizer.model"))
    piece_c, piece_d = sp.IdToPiece(fx.token_c), sp.IdToPiece(fx.token_d)

    n = 32
    matched = _serve(target, drafter, n)
    timings = matched["timings"]
    assert timings["draft_n"] > 0, timings
    assert timings["draft_n_accepted"] / timings["draft_n"] > 0.8, timings
    assert matched["tokens_predicted"] == n and matched["content"] == piece_c * n, matched["content"]

    other = _serve(perturbed, drafter, n)
    timings = other["timings"]
    assert timings["draft_n"] > 0, timings
    assert timings["draft_n_accepted"] / timings["draft_n"] < 0.05, timings
    assert other["tokens_predicted"] == n and other["content"] == piece_d * n, other["content"]
    REFERENCE_COMPARISONS.append("llama-server/acceptance")
