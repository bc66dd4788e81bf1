"""Gemma-4 text targets, as b11434's ``Gemma4Model`` / ``Gemma4UnifiedModel`` (conversion/gemma.py) write them.

Only the language model: b11434's text conversion drops the vision and audio towers (their projector
is a separate mmproj file, not needed to serve text). What is particular to Gemma-4:

* two attention layer types (``layer_types``): sliding layers with ``head_dim`` and
  ``num_key_value_heads``, full layers with ``global_head_dim`` and ``num_global_key_value_heads``,
  written as per-layer arrays; full layers with ``attention_k_eq_v`` have no ``v_proj`` (V = K);
* per-layer-type rope: ``rope.freq_base`` / ``freq_base_swa``, and a generated ``rope_freqs`` tensor
  that leaves the unrotated dims of the "proportional" full-attention rope alone (1e30 factors);
* ``layer_scalar`` -> ``blk.N.layer_output_scale``; norms stored unshifted (no Gemma-3 ``+1``);
* ``token_embd`` trimmed to the tokenizer's size; tied embeddings (``lm_head`` only when present);
* shared-KV layers (the last ``num_kv_shared_layers``) may lack k/v; a double-wide MLP there;
* Unified checkpoints: ``suppress_tokens`` from generation_config.json;
* mixture-of-experts layers (26B-A4B): router (F32) and its scales, fused gate/up experts;
* per-layer embeddings (E2B/E4B): the per-layer token table, its projection and norms.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import Keys, LlamaFileType
from sentencepiece import SentencePieceProcessor

from ...errors import ConfigError, TensorError, UnsupportedModelError
from ...ggufio import GGUFPlan
from ...jsonfile import read_json
from ...tensor_names import DECODER_BLOCK, QK_NORM, TEXT_MODEL, block_map
from ..configs import TargetArch
from ..vocab import VocabInfo, add_gemma4_vocab
from .base import TensorSpec, TextFamily, add_text_hparams, block_id, trimmed_rows

UNIFIED = "Gemma4UnifiedForConditionalGeneration"  # b11434's Gemma4UnifiedModel: writes suppress_tokens too
ARCH = TargetArch("gemma4", ("Gemma4ForConditionalGeneration", UNIFIED, "Gemma4ForCausalLM"), True, "gemma4",
                  graph="gemma4.cpp")
ARCHS = (ARCH,)
SUPPRESS_TOKENS = "tokenizer.ggml.suppress_tokens"  # gguf-py Keys.Tokenizer.SUPPRESS_TOKENS (b11434; not in 0.19.0)

# Normalised HF name (``language_model.`` dropped) -> GGUF name; b11434 gguf-py tensor_mapping.py, GEMMA4.
TENSOR_MAP = {
    **TEXT_MODEL,
    # Gemma's sandwich norms: post_attention_layernorm is a post-norm here, the FFN pre-norm is its own tensor
    **block_map(DECODER_BLOCK | QK_NORM | {"post_attention_layernorm": "post_attention_norm",
                                           "pre_feedforward_layernorm": "ffn_norm",
                                           "post_feedforward_layernorm": "post_ffw_norm",
                                           "layer_scalar": "layer_output_scale"}),
    # per-layer embeddings (E2B/E4B)
    "model.embed_tokens_per_layer": "per_layer_token_embd",
    "model.per_layer_model_projection": "per_layer_model_proj",
    "model.per_layer_projection_norm": "per_layer_proj_norm",
    "model.layers.{bid}.per_layer_input_gate": "blk.{bid}.inp_gate",
    "model.layers.{bid}.per_layer_projection": "blk.{bid}.proj",
    "model.layers.{bid}.post_per_layer_input_norm": "blk.{bid}.post_norm",
    # mixture-of-experts layers (26B-A4B): a router and fused experts beside the dense MLP
    "model.layers.{bid}.router.proj": "blk.{bid}.ffn_gate_inp",
    "model.layers.{bid}.experts.gate_up_proj": "blk.{bid}.ffn_gate_up_exps",
    "model.layers.{bid}.experts.down_proj": "blk.{bid}.ffn_down_exps",
    "model.layers.{bid}.pre_feedforward_layernorm_2": "blk.{bid}.pre_ffw_norm_2",
    "model.layers.{bid}.post_feedforward_layernorm_1": "blk.{bid}.post_ffw_norm_1",
    "model.layers.{bid}.post_feedforward_layernorm_2": "blk.{bid}.post_ffw_norm_2",
}
# Gemma4Model.modify_tensors: two router tensors become ``.scale`` tensors of the GGUF names.
SCALE_TENSORS = {"router.scale": "blk.{bid}.ffn_gate_inp.scale",
                 "router.per_expert_scale": "blk.{bid}.ffn_down_exps.scale"}


class Gemma4Family(TextFamily):
    gguf_arch = ARCH.gguf
    tensor_map = TENSOR_MAP

    # -- config ---------------------------------------------------------------------------------
    def _require(self, key: str) -> Any:
        if key not in self.hp:
            raise ConfigError(f"{self.src.config.path}: field '{key}' (under text_config) is missing; llama.cpp "
                              "b11434's Gemma-4 converter needs it. Use the config.json published with the model.")
        return self.hp[key]

    def check_config(self) -> None:
        path = self.src.config.path
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "intermediate_size",
                    "layer_types", "num_kv_shared_layers", "vocab_size", "sliding_window"):
            self._require(key)
        if len(self.hp["layer_types"]) != self.block_count:
            raise ConfigError(f"{path}: layer_types has {len(self.hp['layer_types'])} entries for "
                              f"{self.block_count} layers. Use the config.json published with the model.")
        if self.head_dim_full() is None:
            raise ConfigError(f"{path}: neither 'global_head_dim' nor a full-attention 'per_layer_config' entry "
                              "gives the head size of the full-attention layers. Use the published config.json.")
        if self.is_moe():
            for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                if not self.hp.get(key):
                    raise ConfigError(f"{path}: a Gemma-4 mixture-of-experts config (enable_moe_block) without "
                                      f"'{key}'. Use the config.json published with the model.")
        elif self.find_hparam(("num_experts", "num_local_experts"), True):
            raise UnsupportedModelError(
                f"{path}: num_experts is set but enable_moe_block is not; this is not a Gemma-4 layout llama.cpp "
                "b11434 knows. Convert it with llama.cpp's converter (--llama-cpp DIR) or pass --target-gguf.")
        if self.hp.get("hidden_size_per_layer_input") and not self.hp.get("vocab_size_per_layer_input"):
            raise ConfigError(f"{path}: hidden_size_per_layer_input is set (per-layer embeddings, as in E2B/E4B) "
                              "but vocab_size_per_layer_input is missing. Use the config.json published with "
                              "the model.")
        if self.hp.get("attn_logit_softcapping") is not None:
            raise UnsupportedModelError(f"{path}: attn_logit_softcapping is set; Gemma-3/4 have none and llama.cpp "
                                        "b11434's converter stops on it (Gemma3Model.set_gguf_parameters).")
        full = (self.rope_parameters().get("full_attention") or {})
        if full.get("rope_type") != "proportional" or "partial_rotary_factor" not in full:
            raise UnsupportedModelError(
                f"{path}: rope_parameters.full_attention is {full!r}; llama.cpp b11434's Gemma-4 converter handles "
                "only the 'proportional' rope with a partial_rotary_factor (it builds rope_freqs from them).")

    def is_moe(self) -> bool:
        return bool(self.hp.get("enable_moe_block"))

    def _from_layer_config(self, key: str) -> Any:
        """The first full-attention layer's ``key`` in ``per_layer_config`` (b11434's fallback)."""
        types = self.hp.get("layer_types", [])
        for idx, cfg in (self.hp.get("per_layer_config") or {}).items():
            if int(idx) < len(types) and types[int(idx)] == "full_attention" and key in cfg:
                return cfg[key]
        return None

    def head_dim_full(self) -> int | None:
        value = self.hp.get("global_head_dim")
        return value if value is not None else self._from_layer_config("head_dim")

    def kv_heads_full(self) -> int | None:
        value = self.hp.get("num_global_key_value_heads")
        return value if value is not None else self._from_layer_config("num_key_value_heads")

    def swa_layers(self) -> list[bool]:
        return [t == "sliding_attention" for t in self.hp["layer_types"]]

    def first_shared_kv_layer(self) -> int:
        return self.block_count - int(self.hp["num_kv_shared_layers"])

    # -- tensors --------------------------------------------------------------------------------
    def normalise_name(self, hf_name: str) -> str:
        if hf_name.endswith(("per_dim_scale", "layer_scalar")):  # Gemma4Model.filter_tensors
            hf_name += ".weight"
        if ".experts." in hf_name and not hf_name.endswith((".weight", ".weight_scale", ".weight_scale_2",
                                                            ".input_scale")):
            hf_name += ".weight"
        return super().normalise_name(hf_name)

    def gguf_name(self, name: str) -> str | None:
        for suffix, gguf_name in SCALE_TENSORS.items():
            if name.endswith("." + suffix) and (bid := block_id(name)) is not None:
                return gguf_name.format(bid=bid) if name == f"model.layers.{bid}.{suffix}" else None
        return super().gguf_name(name)

    def force_f32(self, name: str) -> bool:
        return name.endswith(".ffn_gate_inp.weight")  # FFN_GATE_INP stays F32 (prepare_tensors)

    def extra_tensors(self) -> list[TensorSpec]:
        """rope_freqs: 1 for the rotated half-dims of a full layer, 1e30 (never rotated) for the rest."""
        full = self.rope_parameters()["full_attention"]
        hd = int(self.head_dim_full() or 0)
        n_rot = int(hd * full["partial_rotary_factor"] / 2)
        values = np.array([1.0] * n_rot + [1e30] * (hd // 2 - n_rot), dtype=np.float32)
        return [TensorSpec("rope_freqs.weight", (len(values),), data=values)]

    def vocab_rows(self) -> int:
        """Gemma3Model.modify_tensors: rows of token_embd kept (the tokenizer's real size)."""
        tok = self.src.tok_dir
        if (tok / "tokenizer.model").is_file():
            sp = SentencePieceProcessor()
            sp.LoadFromFile(str(tok / "tokenizer.model"))
            return int(self.find_hparam(("vocab_size_per_layer_input", "vocab_size"), True) or sp.vocab_size())
        tj = read_json(tok / "tokenizer.json")
        return len(tj["model"]["vocab"]) + len(tj.get("added_tokens", []))

    def n_tokens(self) -> int:
        """Tokens the vocabulary will hold (tokenizer.json's vocab, then added tokens past its end)."""
        tj = read_json(self.src.tok_dir / "tokenizer.json")
        n_base = len(tj["model"]["vocab"])
        return n_base + sum(1 for t in tj.get("added_tokens", []) if t["id"] >= n_base)

    def modify(self, spec: TensorSpec, hf_name: str) -> list[TensorSpec]:
        if "embed_tokens.weight" in hf_name and spec.ref is not None:
            ref = trimmed_rows(spec.ref, self.vocab_rows())
            if ref.shape[0] != (n := self.n_tokens()):
                raise TensorError(
                    f"{spec.ref.path}: {hf_name} has {spec.ref.shape[0]} rows; trimmed as llama.cpp b11434 trims it "
                    f"({self.vocab_rows()} = tokenizer.json vocab + added_tokens) it keeps {ref.shape[0]}, but the "
                    f"vocabulary in {self.src.tok_dir / 'tokenizer.json'} has {n} tokens, and llama.cpp refuses a "
                    "token_embd whose rows differ from the token count ('wrong shape'). The tokenizer does not "
                    "belong to these weights: use the tokenizer files published with the model.")
            return [TensorSpec(spec.name, ref.shape, ref=ref)]
        return [spec]

    def expected_shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        hp = self.hp
        h, v, nh = int(hp["hidden_size"]), int(hp["vocab_size"]), int(hp["num_attention_heads"])
        hd_swa, hd_full = int(hp["head_dim"]), int(self.head_dim_full() or 0)
        kv_swa = int(hp.get("num_key_value_heads") or nh)
        kv_full = int(self.kv_heads_full() or kv_swa)
        ff, first_shared = int(hp["intermediate_size"]), self.first_shared_kv_layer()
        k_eq_v = bool(hp.get("attention_k_eq_v"))
        required: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
        optional: dict[str, tuple[int, ...]] = {"output.weight": (v, h)}
        if n_pl := int(hp.get("hidden_size_per_layer_input") or 0):
            n_all = n_pl * self.block_count
            required.update({"per_layer_token_embd.weight": (int(hp["vocab_size_per_layer_input"]), n_all),
                             "per_layer_model_proj.weight": (n_all, h), "per_layer_proj_norm.weight": (n_pl,)})
        for i, swa in enumerate(self.swa_layers()):
            hd, kv = (hd_swa, kv_swa) if swa else (hd_full, kv_full)
            n_ff = ff * 2 if hp.get("use_double_wide_mlp") and i >= first_shared else ff
            b = f"blk.{i}."
            required.update({
                b + "attn_norm.weight": (h,), b + "attn_q.weight": (nh * hd, h), b + "attn_output.weight": (h, nh * hd),
                b + "attn_q_norm.weight": (hd,), b + "post_attention_norm.weight": (h,), b + "ffn_norm.weight": (h,),
                b + "ffn_gate.weight": (n_ff, h), b + "ffn_up.weight": (n_ff, h), b + "ffn_down.weight": (h, n_ff),
                b + "post_ffw_norm.weight": (h,),
            })
            kv_tensors = {b + "attn_k.weight": (kv * hd, h), b + "attn_k_norm.weight": (hd,)}
            v_tensor = {b + "attn_v.weight": (kv * hd, h)}
            (optional if i >= first_shared else required).update(kv_tensors)
            (optional if i >= first_shared or (k_eq_v and not swa) else required).update(v_tensor)
            optional[b + "layer_output_scale.weight"] = (1,)
            if n_pl:
                required.update({b + "inp_gate.weight": (n_pl, h), b + "proj.weight": (h, n_pl),
                                 b + "post_norm.weight": (h,)})
            if self.is_moe():
                n_exp, moe_ff = int(hp["num_experts"]), int(hp["moe_intermediate_size"])
                required.update({
                    b + "ffn_gate_inp.weight": (n_exp, h), b + "ffn_gate_inp.scale": (h,),
                    b + "ffn_gate_up_exps.weight": (n_exp, 2 * moe_ff, h),
                    b + "ffn_down_exps.weight": (n_exp, h, moe_ff), b + "ffn_down_exps.scale": (n_exp,),
                    b + "pre_ffw_norm_2.weight": (h,), b + "post_ffw_norm_1.weight": (h,),
                    b + "post_ffw_norm_2.weight": (h,),
                })
        return required, optional

    # -- metadata -------------------------------------------------------------------------------
    def add_hparams(self, plan: GGUFPlan, ftype: LlamaFileType) -> None:
        """TextModel, then Gemma3Model, then Gemma4Model.set_gguf_parameters (keys re-set keep their place)."""
        hp, k = self.hp, self.key
        add_text_hparams(self, plan, ftype)
        # Gemma3Model: defaults for keys a config may leave out
        plan.add_uint32(k(Keys.LLM.CONTEXT_LENGTH), hp.get("max_position_embeddings", 131072))
        plan.add_uint32(k(Keys.Attention.HEAD_COUNT), hp.get("num_attention_heads", 8))
        plan.add_float32(k(Keys.Attention.LAYERNORM_RMS_EPS), hp.get("rms_norm_eps", 1e-6))
        plan.add_uint32(k(Keys.Attention.KEY_LENGTH), hp.get("head_dim", 256))
        plan.add_uint32(k(Keys.Attention.VALUE_LENGTH), hp.get("head_dim", 256))
        rope = self.rope_parameters()
        plan.add_float32(k(Keys.Rope.FREQ_BASE), rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
        if softcap := hp.get("final_logit_softcapping"):
            plan.add_float32(k(Keys.LLM.FINAL_LOGIT_SOFTCAPPING), softcap)
        if hp.get("sliding_window_pattern") != 1:
            plan.add_uint32(k(Keys.Attention.SLIDING_WINDOW), hp["sliding_window"])
        plan.add_uint32(k(Keys.Attention.HEAD_COUNT_KV), hp.get("num_key_value_heads", 4))
        # Gemma4Model
        plan.add_uint32(k(Keys.Attention.SHARED_KV_LAYERS), hp["num_kv_shared_layers"])
        plan.add_uint32(k(Keys.LLM.EMBD_LENGTH_PER_LAYER_INP), hp.get("hidden_size_per_layer_input") or 0)
        swa = self.swa_layers()
        plan.add_array(k(Keys.Attention.SLIDING_WINDOW_PATTERN), swa)
        hd_full, hd_swa = self.head_dim_full(), hp["head_dim"]
        assert hd_full is not None, "check_config refuses a config without a full-attention head size"
        plan.add_uint32(k(Keys.Attention.KEY_LENGTH), hd_full)
        plan.add_uint32(k(Keys.Attention.VALUE_LENGTH), hd_full)
        plan.add_uint32(k(Keys.Attention.KEY_LENGTH_SWA), hd_swa)
        plan.add_uint32(k(Keys.Attention.VALUE_LENGTH_SWA), hd_swa)
        if (n_ff_exp := self.find_hparam(("expert_intermediate_size", "moe_intermediate_size"), True)) is not None:
            plan.add_uint32(k(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), n_ff_exp)
        if hp.get("use_double_wide_mlp", False):
            n_ff, first_shared = hp["intermediate_size"], self.first_shared_kv_layer()
            plan.add_array(k(Keys.LLM.FEED_FORWARD_LENGTH),
                           [n_ff if i < first_shared else n_ff * 2 for i in range(self.block_count)])
        kv_full, kv_swa = self.kv_heads_full(), hp.get("num_key_value_heads")
        if kv_full is not None and kv_swa is not None:
            plan.add_array(k(Keys.Attention.HEAD_COUNT_KV), [kv_swa if s else kv_full for s in swa])
        prf_swa = rope.get("partial_rotary_factor", 1.0)
        plan.add_uint32(k(Keys.Rope.DIMENSION_COUNT), int(hd_full))
        plan.add_uint32(k(Keys.Rope.DIMENSION_COUNT_SWA), int(hd_swa * prf_swa))
        if self.src.config.arch == UNIFIED:
            gen = self.src.model_dir / "generation_config.json"
            if gen.is_file() and (suppress := read_json(gen).get("suppress_tokens")) is not None:
                plan.add_array(SUPPRESS_TOKENS, suppress)

    def add_vocab(self, plan: GGUFPlan) -> VocabInfo:
        return add_gemma4_vocab(plan, self.src.tok_dir)


FAMILY = Gemma4Family
