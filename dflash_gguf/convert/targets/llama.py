"""Llama-3.x targets (``LlamaForCausalLM``), as b11434's ``LlamaModel`` (conversion/llama.py) writes them.

What is particular to Llama:

* q/k permutation: HF stores each head's rotary pairs as two halves (``rotate_half``), llama.cpp's
  rope wants them interleaved, so b11434 reorders the rows of ``q_proj`` / ``k_proj`` (and their
  biases) inside every head (``LlamaModel.permute``; ``k`` with the KV head count). Only whole rows
  move, so it is streamed like any other tensor: each output chunk reads its source rows.
* ``rope_type: llama3`` scaling is not a GGUF key: b11434 generates a ``rope_freqs`` tensor of
  per-frequency factors (``LlamaModel.generate_extra_tensors``), written before the checkpoint's.
* ``llama.vocab_size`` and ``llama.rope.dimension_count`` follow the generic keys; ``head_dim``
  always has a value because b11434 reads the config through transformers' ``LlamaConfig``.
* tied embeddings (Llama-3.2 1B/3B): no ``lm_head`` in the checkpoint, so no ``output`` tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from gguf import Keys, LlamaFileType

from ...errors import ConfigError, UnsupportedModelError
from ...ggufio import GGUFPlan
from ...tensor_names import DECODER_BLOCK, TEXT_MODEL, block_map
from ..configs import TargetArch
from .base import TensorSpec, TextFamily, add_text_hparams

ARCH = TargetArch("llama", ("LlamaForCausalLM",), True, "sentencepiece-or-gpt2", graph="llama.cpp")
ARCHS = (ARCH,)

# Normalised HF name -> GGUF name; b11434 gguf-py tensor_mapping.py for MODEL_ARCH.LLAMA.
TENSOR_MAP = {**TEXT_MODEL, **block_map(DECODER_BLOCK)}

# transformers 4.57 LlamaConfig defaults: b11434 loads hparams with AutoConfig, so these apply when absent.
_CONFIG_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "max_position_embeddings": 2048, "intermediate_size": 11008, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
    "tie_word_embeddings": False,
}
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# vocab sizes b11434's LlamaModel.set_vocab special-cases (CodeLlama infill tokens, small Granite/SmolLM models).
_SPECIAL_VOCAB_SIZES = {32016: "CodeLlama's infill tokens", 49152: "add_bos_token forced off"}


def llama3_rope_factors(theta: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_context: int) -> np.ndarray:
    """Per-frequency rope factors of ``rope_type: llama3`` (the ``rope_freqs`` tensor), in F32 as b11434's
    ``generate_extra_tensors`` computes them with torch: every step rounded to float32.

    High frequencies (wavelength under ``original_context / high_freq_factor``) keep factor 1, low ones
    (over ``original_context / low_freq_factor``) get ``factor``, the band between is interpolated.
    """
    f32 = np.float32
    one = f32(1.0)
    # base ** (2i/dim): computed in float64 and rounded once, i.e. the correctly rounded float32 power.
    # torch's vectorised powf (SLEEF, error under 1 ulp) agrees for the Llama-3.x shapes (head_dim 64/128,
    # theta 500000); for other shapes a rare entry of the blended band can differ in its last bits.
    exponent = np.arange(0, dim, 2, dtype=f32) / f32(dim)
    freqs = one / (np.float64(f32(theta)) ** exponent.astype(np.float64)).astype(f32)
    low_wavelen, high_wavelen = f32(original_context / low_freq_factor), f32(original_context / high_freq_factor)
    out = np.empty(len(freqs), dtype=f32)
    for i, freq in enumerate(freqs):
        # torch evaluates ``scalar / tensor`` as ``tensor.reciprocal() * scalar``; the order of roundings matters.
        wavelen = (one / freq) * f32(2 * math.pi)
        if wavelen < high_wavelen:
            out[i] = 1.0
        elif wavelen > low_wavelen:
            out[i] = factor
        else:
            smooth = ((one / wavelen) * f32(original_context) - f32(low_freq_factor)) \
                / f32(high_freq_factor - low_freq_factor)
            out[i] = one / ((one - smooth) / f32(factor) + smooth)
    return out


def rope_row_order(n_rows: int, n_head: int) -> np.ndarray:
    """Source row of each output row when each head's two rotary halves are interleaved.

    Within a head of ``hd`` rows, output row ``2*i + j`` is source row ``j*hd/2 + i`` (i < hd/2, j in 0, 1):
    the first half's rows land on even positions, the second half's on odd ones.
    """
    hd = n_rows // n_head
    half = hd // 2
    within = np.empty(hd, dtype=np.int64)
    within[0::2] = np.arange(half)
    within[1::2] = np.arange(half) + half
    return (np.arange(n_head, dtype=np.int64)[:, None] * hd + within[None, :]).reshape(-1)


class LlamaFamily(TextFamily):
    gguf_arch = ARCH.gguf
    tensor_map = TENSOR_MAP

    # -- config ---------------------------------------------------------------------------------
    @classmethod
    def load_hparams(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """config.json with transformers' LlamaConfig defaults filled in, as ``AutoConfig`` returns it."""
        hp = {**_CONFIG_DEFAULTS, **super().load_hparams(raw)}
        heads, hidden = hp.get("num_attention_heads"), hp.get("hidden_size")
        if hp.get("num_key_value_heads") is None:  # LlamaConfig: None (or absent) means no grouping
            hp["num_key_value_heads"] = heads
        if hp.get("head_dim") is None and isinstance(heads, int) and heads > 0 and isinstance(hidden, int):
            hp["head_dim"] = hidden // heads
        return hp

    def check_config(self) -> None:
        path = self.src.config.path
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "vocab_size"):
            if not isinstance(self.hp.get(key), int) or self.hp[key] <= 0:
                raise ConfigError(f"{path}: field '{key}' is missing or not a positive integer. Use the "
                                  "config.json published with the model.")
        heads, kv, hd = self.n_head, self.n_head_kv, int(self.hp["head_dim"])
        if heads % kv or hd % 2:
            raise ConfigError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{kv}, or head_dim {hd} is odd. Use the config.json published with the model.")
        if "draft_vocab_size" in self.hp and self.block_count == 1:
            raise UnsupportedModelError(
                f"{path}: an EAGLE-3 draft head (draft_vocab_size, one layer), not a target model. llama.cpp "
                "b11434 converts it as arch eagle3 with --target-model-dir; the built-in converter does not. "
                "Convert it with llama.cpp's converter (--llama-cpp DIR).")
        if (why := _SPECIAL_VOCAB_SIZES.get(int(self.hp["vocab_size"]))) is not None:
            raise UnsupportedModelError(
                f"{path}: vocab_size {self.hp['vocab_size']} is a vocabulary llama.cpp b11434's LlamaModel treats "
                f"specially ({why}), which the built-in converter does not mirror. Convert this target with "
                "llama.cpp's converter (--llama-cpp DIR), or pass an existing GGUF of it with --target-gguf.")
        rope = self.rope_params()
        if str(rope.get("rope_type", "")).lower() == "llama3" and (
                missing := [k for k in _LLAMA3_ROPE_KEYS if rope.get(k) is None]):
            raise ConfigError(
                f"{path}: rope_scaling has rope_type 'llama3' but lacks {missing}; transformers refuses such a "
                "config and llama.cpp b11434 would then fall back to guessed values. Use the config.json "
                "published with the model.")

    @property
    def n_head(self) -> int:
        return int(self.hp["num_attention_heads"])

    @property
    def n_head_kv(self) -> int:
        return int(self.hp["num_key_value_heads"])

    def rope_params(self) -> dict[str, Any]:
        rope = self.rope_parameters()
        return rope.get("full_attention", rope)

    # -- tensors --------------------------------------------------------------------------------
    def extra_tensors(self) -> list[TensorSpec]:
        rope = self.rope_params()
        if not rope or str(rope.get("rope_type", "")).lower() != "llama3":
            return []
        factors = llama3_rope_factors(
            float(rope.get("rope_theta", 10000.0)), int(self.hp["head_dim"]), float(rope["factor"]),
            float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]))
        return [TensorSpec("rope_freqs.weight", factors.shape, data=factors)]

    def modify(self, spec: TensorSpec, hf_name: str) -> list[TensorSpec]:
        """q_proj / k_proj (weights and biases): interleave each head's rotary halves."""
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = self.n_head
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = self.n_head_kv
        else:
            return [spec]
        return [TensorSpec(spec.name, spec.shape, ref=spec.ref, row_order=rope_row_order(spec.shape[0], heads))]

    def expected_shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        hp = self.hp
        h, ff, v, hd = int(hp["hidden_size"]), int(hp["intermediate_size"]), int(hp["vocab_size"]), int(hp["head_dim"])
        q, kv = self.n_head * hd, self.n_head_kv * hd
        required: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
        # Untied: lm_head must be there. Tied checkpoints usually omit it; b11434 writes it when present.
        optional: dict[str, tuple[int, ...]] = {}
        (optional if hp.get("tie_word_embeddings") else required)["output.weight"] = (v, h)
        for i in range(self.block_count):
            b = f"blk.{i}"
            required.update({
                f"{b}.attn_norm.weight": (h,), f"{b}.ffn_norm.weight": (h,),
                f"{b}.attn_q.weight": (q, h), f"{b}.attn_k.weight": (kv, h), f"{b}.attn_v.weight": (kv, h),
                f"{b}.attn_output.weight": (h, q),
                f"{b}.ffn_gate.weight": (ff, h), f"{b}.ffn_up.weight": (ff, h), f"{b}.ffn_down.weight": (h, ff),
            })
            biases = {}
            if hp.get("attention_bias"):
                biases.update({f"{b}.attn_q.bias": (q,), f"{b}.attn_k.bias": (kv,), f"{b}.attn_v.bias": (kv,),
                               f"{b}.attn_output.bias": (h,)})
            if hp.get("mlp_bias"):
                biases.update({f"{b}.ffn_gate.bias": (ff,), f"{b}.ffn_up.bias": (ff,), f"{b}.ffn_down.bias": (h,)})
            required.update(biases)
        return required, optional

    # -- metadata -------------------------------------------------------------------------------
    def add_hparams(self, plan: GGUFPlan, ftype: LlamaFileType) -> None:
        """LlamaModel.set_gguf_parameters: the generic keys, then vocab size and rope dimensions."""
        add_text_hparams(self, plan, ftype)
        plan.add_uint32(self.key(Keys.LLM.VOCAB_SIZE), int(self.hp["vocab_size"]))
        plan.add_uint32(self.key(Keys.Rope.DIMENSION_COUNT), int(self.hp["head_dim"]))


FAMILY = LlamaFamily
