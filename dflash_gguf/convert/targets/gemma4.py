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

The towers go to the projector file (``--mmproj``), as b11434's ``Gemma4VisionAudioModel`` (a SigLIP-style
vision encoder and a Conformer audio encoder, audio optional) and ``Gemma4UnifiedVisionAudioModel`` (12B:
encoder-free, a patch projection and two embedders) write them: see :class:`Gemma4Projector`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, Keys, LlamaFileType
from sentencepiece import SentencePieceProcessor

from ...errors import ConfigError, TensorError, UnsupportedModelError
from ...ggufio import GGUFPlan
from ...jsonfile import read_json
from ...tensor_names import DECODER_BLOCK, QK_NORM, TEXT_MODEL, block_map
from ..configs import ProjectorType, TargetArch
from ..safetensors import TensorRef
from ..vocab import VocabInfo, add_gemma4_vocab
from .base import TensorSpec, TextFamily, add_text_hparams, block_id, trimmed_rows
from .projector import Expect, ProjectorFamily, gathered, patch_columns, softplus

UNIFIED = "Gemma4UnifiedForConditionalGeneration"  # b11434's Gemma4UnifiedModel: writes suppress_tokens too
# The projector towers (tools/mtmd/mtmd.cpp wraps each image in <|image> ... <image|>, each clip in <|audio> ...)
_IMAGE, _AUDIO = ("<|image>", "<image|>"), ("<|audio>", "<audio|>")
VISION, AUDIO = ProjectorType("gemma4v", "vision", _IMAGE), ProjectorType("gemma4a", "audio", _AUDIO)
UNIFIED_VISION, UNIFIED_AUDIO = ProjectorType("gemma4uv", "vision", _IMAGE), ProjectorType("gemma4ua", "audio", _AUDIO)
ARCH = TargetArch("gemma4", ("Gemma4ForConditionalGeneration", UNIFIED, "Gemma4ForCausalLM"), True, "gemma4",
                  graph="gemma4.cpp", projectors=(VISION, AUDIO, UNIFIED_VISION, UNIFIED_AUDIO))
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


# ---------------------------------------------------------------------------------------------- the projector
_VT, _AT, _EV, _EA = "model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio."
_CLAMPS = ("input_min", "input_max", "output_min", "output_max")  # Gemma4ClippableLinear's 0-d bounds, if clipped
_MAX_BLOCKS = 128  # b11434 maps tower layers 0..127 when a model has vision and audio encoders
# transformers' Gemma4VisionConfig / Gemma4AudioConfig defaults, for fields a config.json leaves out
_VISION_DEFAULTS = {"num_key_value_heads": 12, "head_dim": 64, "position_embedding_size": 10 * 1024}
_AUDIO_DEFAULTS = {"conv_kernel_size": 5, "output_proj_dims": 1536}
_UNIFIED_AUDIO_FRAME = 640  # samples per audio token; libmtmd's gemma4ua graph is built for this width


def _linear(prefix: str, hf: str, gguf: str, shape: tuple[int, ...]) -> dict[str, Expect]:
    """A Gemma4ClippableLinear: its ``.linear.weight`` and, when clipped, four scalar bounds."""
    return {f"{prefix}{hf}.linear.weight": Expect(f"{gguf}.weight", shape),
            **{f"{prefix}{hf}.{c}": Expect(f"{gguf}.{c}", (), False) for c in _CLAMPS}}


def _weights(prefix: str, gguf: str, table: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Expect]:
    return {f"{prefix}{hf}.weight": Expect(f"{gguf}{name}.weight", shape) for hf, (name, shape) in table.items()}


class Gemma4Projector(ProjectorFamily):
    """b11434's ``Gemma4VisionAudioModel``: projector types gemma4v (+ gemma4a when there is an audio_config)."""

    has_audio = True
    vision_type, audio_type = VISION.name, AUDIO.name

    def setup(self) -> None:
        hv, ha = self.hparams_vision, self.hparams_audio
        if isinstance(hv, dict):
            hv["image_size"] = 224  # unused by llama.cpp, set by b11434 to satisfy MmprojModel
        if isinstance(ha, dict) and ha:
            ha["feat_in"] = ha.get("input_feat_size", 128)
            if isinstance(ha.get("hidden_size"), int):
                ha["intermediate_size"] = ha["hidden_size"] * 4
        else:
            self.audio = False

    def expected(self) -> dict[str, Expect]:
        out = self._vision_expected()
        return {**out, **self._audio_expected()} if self.audio else out

    def _vision_expected(self) -> dict[str, Expect]:
        hv, w = self.vision_cfg(), "vision_config"
        h, ff, n, nh, nkv, hd, ps, pos = (self.int_field(hv, (k,), w, _VISION_DEFAULTS.get(k)) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "patch_size", "position_embedding_size"))
        if n > _MAX_BLOCKS:
            raise self.refuse(f"vision_config.num_hidden_layers is {n}, over the {_MAX_BLOCKS} b11434 maps;")
        if nkv != nh or nh * hd != h:
            raise UnsupportedModelError(
                f"{self.src.config_path}: vision_config has num_key_value_heads {nkv}, num_attention_heads {nh}, "
                f"head_dim {hd}, hidden_size {h}; llama.cpp b11434's gemma4v graph takes as many KV heads as heads, "
                "each hidden_size / heads wide (b11434 writes neither size), so the projector b11434 writes fails "
                "in libmtmd. Use the config.json published with the model.")
        out = {_VT + "patch_embedder.input_proj.weight": Expect("v.patch_embd.weight", (h, 3 * ps * ps)),
               _VT + "patch_embedder.position_embedding_table": Expect("v.position_embd.weight", (2, pos, h)),
               _VT + "std_bias": Expect("v.std_bias", (h,), False),
               _VT + "std_scale": Expect("v.std_scale", (h,), False),
               _EV + "embedding_projection.weight": Expect("mm.input_projection.weight", (self.n_embd_text, h))}
        for i in range(n):
            p, g = f"{_VT}encoder.layers.{i}.", f"v.blk.{i}."
            for hf, name, shape in (
                    ("self_attn.q_proj", "attn_q", (nh * hd, h)), ("self_attn.k_proj", "attn_k", (nkv * hd, h)),
                    ("self_attn.v_proj", "attn_v", (nkv * hd, h)), ("self_attn.o_proj", "attn_out", (h, nh * hd)),
                    ("mlp.gate_proj", "ffn_gate", (ff, h)), ("mlp.up_proj", "ffn_up", (ff, h)),
                    ("mlp.down_proj", "ffn_down", (h, ff))):
                out.update(_linear(p, hf, g + name, shape))
            out.update(_weights(p, g, {
                "self_attn.q_norm": ("attn_q_norm", (hd,)), "self_attn.k_norm": ("attn_k_norm", (hd,)),
                "input_layernorm": ("ln1", (h,)), "post_attention_layernorm": ("attn_post_norm", (h,)),
                "pre_feedforward_layernorm": ("ln2", (h,)), "post_feedforward_layernorm": ("ffn_post_norm", (h,))}))
            out[p + "layer_scalar"] = Expect(g + "out_scale.weight", (1,), False)
        return out

    def _audio_expected(self) -> dict[str, Expect]:
        ha, w = self.audio_cfg(), "audio_config"
        h, n, nh, kern, n_out = (self.int_field(ha, (k,), w, _AUDIO_DEFAULTS.get(k)) for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "conv_kernel_size", "output_proj_dims"))
        chans = ha.get("subsampling_conv_channels", [128, 32])
        if not (isinstance(chans, list) and len(chans) == 2 and all(isinstance(c, int) and c > 0 for c in chans)):
            raise self.refuse(f"audio_config.subsampling_conv_channels is {chans!r}, not two channel counts;")
        if n > _MAX_BLOCKS or nh == 0 or h % nh:
            raise self.refuse(f"audio_config has {n} layers {h} wide with {nh} heads, not a Conformer b11434 maps;")
        sub = _AT + "subsample_conv_projection."
        out = {f"{sub}layer{j}.conv.weight": Expect(f"a.conv1d.{j}.weight", (c, [1, *chans][j], 3, 3))
               for j, c in enumerate(chans)}
        out |= {f"{sub}layer{j}.norm.weight": Expect(f"a.conv1d.{j}.norm.weight", (c,)) for j, c in enumerate(chans)}
        out[sub + "input_proj_linear.weight"] = Expect("a.input_projection.weight", (h, chans[0] // 4 * chans[1]))
        for i in range(n):
            p, g = f"{_AT}layers.{i}.", f"a.blk.{i}."
            for k, sfx in ((1, ""), (2, "_1")):
                out.update(_linear(p, f"feed_forward{k}.ffw_layer_1", f"{g}ffn_up{sfx}", (4 * h, h)))
                out.update(_linear(p, f"feed_forward{k}.ffw_layer_2", f"{g}ffn_down{sfx}", (h, 4 * h)))
                out.update(_weights(p, g, {f"feed_forward{k}.pre_layer_norm": (f"ffn_norm{sfx}", (h,)),
                                           f"feed_forward{k}.post_layer_norm": (f"ffn_post_norm{sfx}", (h,))}))
            for hf, name, shape in (("self_attn.q_proj", "attn_q", (h, h)), ("self_attn.k_proj", "attn_k", (h, h)),
                                    ("self_attn.v_proj", "attn_v", (h, h)), ("self_attn.post", "attn_out", (h, h)),
                                    ("lconv1d.linear_start", "conv_pw1", (2 * h, h)),
                                    ("lconv1d.linear_end", "conv_pw2", (h, h))):
                out.update(_linear(p, hf, g + name, shape))
            out.update(_weights(p, g, {
                "self_attn.relative_k_proj": ("attn_k_rel", (h, h)),
                "lconv1d.depthwise_conv1d": ("conv_dw", (h, 1, kern)),
                "lconv1d.pre_layer_norm": ("conv_norm", (h,)), "lconv1d.conv_norm": ("norm_conv", (h,)),
                "norm_pre_attn": ("attn_pre_norm", (h,)), "norm_post_attn": ("attn_post_norm", (h,)),
                "norm_out": ("ln2", (h,))}))
            out[p + "self_attn.per_dim_scale"] = Expect(g + "per_dim_scale.weight", (h // nh,))
        out |= {_AT + "output_proj.weight": Expect("a.pre_encode.out.weight", (n_out, h)),
                _AT + "output_proj.bias": Expect("a.pre_encode.out.bias", (n_out,)),
                _EA + "embedding_projection.weight": Expect("mm.a.input_projection.weight", (self.n_embd_text, n_out))}
        return out

    def modify(self, name: str, ref: TensorRef, expect: Expect) -> list[TensorSpec]:
        """The patch projection's columns reordered (HWC -> CHW, as ggml's im2col reads a patch), softplus applied
        to per_dim_scale, the depthwise conv kernel squeezed to 2-D."""
        if name == _VT + "patch_embedder.input_proj.weight":
            h, cols = ref.shape
            ps = int(round((cols // 3) ** 0.5))
            perm = patch_columns(ps)
            return [TensorSpec(expect.gguf, (h, 3, ps, ps), ref=ref, transform=lambda x: x[:, perm])]
        if name.endswith(".per_dim_scale"):
            return [TensorSpec(expect.gguf, ref.shape, ref=ref, transform=softplus(ref.dtype))]
        if name.endswith(".depthwise_conv1d.weight"):
            shape = (ref.shape[0], ref.shape[2])
            return [TensorSpec(expect.gguf, shape, ref=TensorRef(ref.name, ref.dtype, shape, ref.path, ref.offset,
                                                                 ref.nbytes))]
        return super().modify(name, ref, expect)

    def force_type(self, name: str, gguf_name: str, ftype: LlamaFileType) -> GGMLQuantizationType | None:
        """Audio convolutions F32 (b11434's test, ``".conv" or "_conv" and ".weight"``, also catches the
        subsample_conv_projection's input_proj_linear), the position table F32."""
        audio = "audio_tower" in name or "embed_audio" in name
        if audio and (".conv" in name or ("_conv" in name and ".weight" in name)) or "position_embedding_table" in name:
            return GGMLQuantizationType.F32
        return super().force_type(name, gguf_name, ftype)

    def add_params(self, plan: GGUFPlan, ftype: LlamaFileType) -> None:
        super().add_params(plan, ftype)
        plan.add_string(Keys.ClipVision.PROJECTOR_TYPE, self.vision_type)
        plan.add_float32(Keys.ClipVision.Attention.LAYERNORM_EPS,
                         self.float_field(self.vision_cfg(), "layer_norm_eps", "vision_config", 1e-6))
        if self.audio:
            ha = self.audio_cfg()
            plan.add_string(Keys.ClipAudio.PROJECTOR_TYPE, self.audio_type)
            plan.add_uint32(Keys.ClipAudio.NUM_MEL_BINS, self.int_field(ha, ("feat_in",), "audio_config"))
            plan.add_float32(Keys.ClipAudio.Attention.LAYERNORM_EPS,
                             self.float_field(ha, "layer_norm_eps", "audio_config", 1e-6))


class Gemma4UnifiedProjector(Gemma4Projector):
    """b11434's ``Gemma4UnifiedVisionAudioModel``: no towers, a patch projection (``vision_embedder``) and the two
    embedders; projector types gemma4uv and gemma4ua (b11434 re-sets the two keys, which keep their place, and
    needs the audio_config)."""

    vision_type, audio_type = UNIFIED_VISION.name, UNIFIED_AUDIO.name

    def setup(self) -> None:
        super().setup()
        hv, ha = self.hparams_vision, self.hparams_audio
        if isinstance(hv, dict) and isinstance(ha, dict) and "mm_embed_dim" in hv and "audio_embed_dim" in ha:
            hv["hidden_size"], ha["hidden_size"] = hv["mm_embed_dim"], ha["audio_embed_dim"]
            for cfg in (hv, ha):  # no transformer: b11434 zeroes the sizes MmprojModel writes
                cfg.update(intermediate_size=0, num_layers=0, num_attention_heads=0)

    def check_config(self) -> None:
        """b11434 reads the embedders' widths first (a KeyError without them)."""
        self.int_field(self.vision_cfg(), ("mm_embed_dim",), "vision_config")
        self.int_field(self.audio_cfg(), ("audio_embed_dim",), "audio_config")
        super().check_config()

    def patch(self) -> int:
        """The merged patch side (model_patch_size, else patch_size x pooling_kernel_size)."""
        hv, w = self.vision_cfg(), "vision_config"
        if "model_patch_size" in hv:
            return self.int_field(hv, ("model_patch_size",), w)
        return self.int_field(hv, ("patch_size",), w) * self.int_field(hv, ("pooling_kernel_size",), w)

    def expected(self) -> dict[str, Expect]:
        hv, ha = self.vision_cfg(), self.audio_cfg()
        d = self.int_field(hv, ("mm_embed_dim",), "vision_config")
        n_pos = self.int_field(hv, ("mm_posemb_size",), "vision_config", 1120)
        a = self.int_field(ha, ("output_proj_dims", "audio_embed_dim"), "audio_config")
        if a != _UNIFIED_AUDIO_FRAME:
            raise UnsupportedModelError(
                f"{self.src.config_path}: audio_config's embedder reads {a}-sample frames; llama.cpp b11434's gemma4ua "
                f"graph feeds it {_UNIFIED_AUDIO_FRAME}, so the projector b11434 writes fails in libmtmd. Use the "
                "config.json published with the model.")
        n_in, ve = 3 * self.patch() ** 2, "model.vision_embedder."
        out = {f"{ve}{ln}.{part}": Expect(f"v.patch_norm.{k}.{part}", (n_in if k == 1 else d,))
               for k, ln in ((1, "patch_ln1"), (2, "patch_ln2"), (3, "pos_norm")) for part in ("weight", "bias")}
        return {**out, ve + "patch_dense.weight": Expect("v.patch_embd.weight", (d, n_in)),
                ve + "patch_dense.bias": Expect("v.patch_embd.bias", (d,)),
                ve + "pos_embedding": Expect("v.position_embd.weight", (n_pos, 2, d)),
                _EV + "embedding_projection.weight": Expect("mm.input_projection.weight", (
                    self.n_embd_text, self.int_field(hv, ("output_proj_dims",), "vision_config", d))),
                _EA + "embedding_projection.weight": Expect("mm.a.input_projection.weight", (self.n_embd_text, a))}

    def modify(self, name: str, ref: TensorRef, expect: Expect) -> list[TensorSpec]:
        """pos_embedding's two leading axes swapped; patch_dense's columns and patch_ln1 reordered to CHW."""
        if name.endswith(".pos_embedding"):
            n_pos, two, d = ref.shape
            order = np.arange(n_pos * two).reshape(n_pos, two).T.reshape(-1)
            return [gathered(expect.gguf, ref, (two, n_pos, d), d, order)]
        perm = patch_columns(self.patch())
        if name.endswith(".patch_dense.weight"):
            return [TensorSpec(expect.gguf, ref.shape, ref=ref, transform=lambda x: x[:, perm])]
        if ".patch_ln1." in name:
            return [TensorSpec(expect.gguf, ref.shape, ref=ref, row_order=perm)]
        return super().modify(name, ref, expect)


# HF class -> projector (b11434 registers its mmproj classes for the ...ForConditionalGeneration classes only)
PROJECTOR = {hf: Gemma4UnifiedProjector if hf == UNIFIED else Gemma4Projector
             for hf in ARCH.hf if hf.endswith("ForConditionalGeneration")}
