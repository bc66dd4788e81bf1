"""Qwen3.5 / Qwen3.6 targets, as b11434's ``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel`` (conversion/qwen.py)
write them.

Both classes stack ``_Qwen35MRopeMixin`` on ``_LinearAttentionVReorderBase`` -> ``Qwen3NextModel`` ->
``_QwenMtpMixin`` -> ``Qwen2MoeModel`` -> ``TextModel``; the dense one writes ``qwen35``, the MoE one
``qwen35moe``. What is particular to them:

* hybrid layers (``layer_types``): gated-DeltaNet ``linear_attention`` layers (``attn_qkv``,
  ``attn_gate``, ``ssm_*``) and gated ``full_attention`` layers (``attn_q`` holds query and gate);
* ``A_log`` -> ``ssm_a = -exp(A_log)``, ``dt_bias`` -> ``ssm_dt.bias``, the conv1d kernel squeezed to 2D,
  every ``*norm.weight`` but the DeltaNet's own ``linear_attn.norm`` shifted by ``+1`` (zero-centred
  RMSNorm weights);
* with fewer linear key heads than value heads, the V heads of in_proj_qkv / z / a / b, conv1d,
  out_proj, A_log and dt_bias go from grouped to tiled order (``_reorder_v_heads``), streamed as a
  row order (or a column order for out_proj);
* the multi-token-prediction block (``mtp.*``) becomes layer ``num_hidden_layers`` (block count and
  ``nextn_predict_layers`` grow by ``mtp_num_hidden_layers``), as b11434 does by default; a checkpoint
  without one (``mtp_num_hidden_layers`` 0 or absent, no ``mtp.*``) converts as b11434's ``--no-mtp``
  does (b11434's default stops on it), and one that declares MTP layers but lacks their tensors is
  refused (b11434 writes a file its loader rejects);
* MoE: router and shared-expert gate kept F32, fused ``mlp.experts.gate_up_proj`` split into
  ``ffn_gate_exps`` / ``ffn_up_exps`` (Qwen2MoeModel.modify_tensors);
* the vision tower (``model.visual.*``) is left out, as in every b11434 text conversion; the projector file
  (``--mmproj``) holds it, as b11434's ``Qwen3VLVisionModel`` writes it (:class:`Qwen35Projector`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from gguf import Keys, LlamaFileType

from ...errors import ConfigError, NotCoveredError, UnsupportedModelError
from ...ggufio import GGUFPlan
from ...tensor_names import DECODER_BLOCK, GATED_DELTA_NET, NEXTN, QK_NORM, QWEN_MOE_MLP, TEXT_MODEL, block_map
from ..configs import ProjectorType, TargetArch
from ..safetensors import TensorRef
from .base import TensorSpec, TextFamily, add_text_hparams, block_id
from .experts import split_gate_up
from .projector import Expect, ProjectorFamily, gathered

# b11434 converts the vision tower with Qwen3VLVisionModel; mtmd wraps each image in <|vision_start|> ... <|vision_end|>
VISION = ProjectorType("qwen3vl_merger", "vision", ("<|vision_start|>", "<|vision_end|>"))
# Qwen3_5TextModel / Qwen3_5MoeTextModel inherit TextModel.set_vocab (conversion/qwen.py)
DENSE = TargetArch("qwen35", ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"), True, "gpt2",
                   graph="qwen35.cpp", mtp_graph=True, output_tap=True, projectors=(VISION,))
MOE = TargetArch("qwen35moe", ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"), True, "gpt2",
                 graph="qwen35moe.cpp", mtp_graph=True, output_tap=True, projectors=(VISION,))
ARCHS = (DENSE, MOE)

RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"  # gguf-py Keys.Attention.RECURRENT_LAYERS (b11434)
DEFAULT_MROPE_SECTION = [11, 11, 10, 0]  # _Qwen35MRopeMixin: written when rope_parameters has none

# Normalised HF name (``language_model.`` dropped, ``mtp.*`` moved to its layer) -> GGUF name; b11434
# gguf-py tensor_mapping.py for MODEL_ARCH.QWEN35 / QWEN35MOE. Which ones a model has is expected_shapes'.
TENSOR_MAP = {
    **TEXT_MODEL,
    **block_map({**DECODER_BLOCK, "post_attention_layernorm": "post_attention_norm"} | QK_NORM),
    **block_map(GATED_DELTA_NET | QWEN_MOE_MLP | NEXTN),
}
# _QwenMtpMixin.filter_tensors: ``mtp.<part>`` tensors of the MTP block itself.
_MTP_REMAP = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
              "norm": "shared_head.norm"}
_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
_MTP_LAYER = re.compile(r"^(?:model\.)?mtp\.layers\.(\d+)\.")


def _v_tiled(n_k: int, n_v: int, head_dim: int) -> np.ndarray:
    """_reorder_v_heads as a gather: output index -> source index, grouped [K0: v0..vr] -> tiled [v0: K0..Kn]."""
    return np.arange(n_v * head_dim).reshape(n_k, n_v // n_k, head_dim).transpose(1, 0, 2).reshape(-1)


def _plus_one(dtype: str) -> Callable[[np.ndarray], np.ndarray]:
    """``w + 1`` as torch computes it: in F32 (b11434 upcasts BF16 first), in F16 for an F16 tensor."""
    if dtype == "F16":
        return lambda x: (x.astype(np.float16) + np.float16(1)).astype(np.float32)
    return lambda x: x + np.float32(1)


def _neg_exp(dtype: str) -> Callable[[np.ndarray], np.ndarray]:
    """``-exp(A_log)``, rounded once from double precision (F16 tensors: to F16, as torch's half exp)."""
    def f(x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            y = np.exp(x.astype(np.float64)).astype(np.float32)
        if dtype == "F16":
            y = y.astype(np.float16).astype(np.float32)
        return -y
    return f


class Qwen35Family(TextFamily):
    tensor_map = TENSOR_MAP

    # -- config ---------------------------------------------------------------------------------
    @property
    def gguf_arch(self) -> str:  # type: ignore[override]  # one module, two b11434 classes: the architecture picks the GGUF arch
        return (MOE if self.src.config.arch in MOE.hf else DENSE).gguf

    def is_moe(self) -> bool:
        return self.src.config.arch in MOE.hf

    def _require(self, key: str) -> Any:
        if self.hp.get(key) is None:
            raise ConfigError(f"{self.src.config.path}: field '{key}' (under text_config) is missing; llama.cpp "
                              "b11434's Qwen3.5 converter needs it. Use the config.json published with the model.")
        return self.hp[key]

    def n_mtp(self) -> int:
        """MTP layers: ``mtp_num_hidden_layers``, else counted from the ``mtp.layers.N`` tensors (_QwenMtpMixin)."""
        if self.drop_mtp:
            return 0
        n = int(self.hp.get("mtp_num_hidden_layers") or 0)
        if n:
            return n
        found = [int(m.group(1)) for name in self.src.tensors if (m := _MTP_LAYER.match(name))]
        return max(found) + 1 if found else 0

    def has_mtp_tensors(self) -> bool:
        return any(name.startswith(("mtp.", "model.mtp.")) for name in self.src.tensors)

    def recurrent(self) -> list[bool]:
        """Linear-attention layers of the trunk: ``layer_types``, else every layer but each interval-th."""
        if (types := self.hp.get("layer_types")) is not None:
            return [t == "linear_attention" for t in types]
        interval = int(self.hp.get("full_attention_interval", 4))
        return [(i + 1) % interval != 0 for i in range(self.block_count)]

    def head_dim(self) -> int:
        hd = self.hp.get("head_dim")
        return int(hd) if hd is not None else int(self.hp["hidden_size"]) // int(self.hp["num_attention_heads"])

    def check_config(self) -> None:
        path, hp = self.src.config.path, self.hp
        if (self.src.model_dir / "helper" / "shim.py").is_file():
            raise NotCoveredError(
                f"{self.src.model_dir}: has helper/shim.py, which makes llama.cpp b11434 convert it as an OpenJev "
                "checkpoint (its own keys and chat template), not as Qwen3.5. Convert it with llama.cpp's converter "
                "(--llama-cpp DIR) or pass --target-gguf.")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_num_key_heads", "linear_num_value_heads"):
            self._require(key)
        for key in (("moe_intermediate_size", "num_experts", "num_experts_per_tok", "shared_expert_intermediate_size")
                    if self.is_moe() else ("intermediate_size",)):
            self._require(key)
        types = hp.get("layer_types")
        if types is not None:
            if len(types) != self.block_count:
                raise ConfigError(f"{path}: layer_types has {len(types)} entries for num_hidden_layers "
                                  f"{self.block_count}; llama.cpp b11434 stops on this (Qwen3NextModel). Use the "
                                  "config.json published with the model.")
            if bad := sorted({t for t in types if t not in ("linear_attention", "full_attention")}):
                raise UnsupportedModelError(f"{path}: layer_types has {bad}; Qwen3.5 layers are 'linear_attention' "
                                            "or 'full_attention'. Convert it with llama.cpp's converter "
                                            "(--llama-cpp DIR) or pass --target-gguf.")
        n_k, n_v = int(hp["linear_num_key_heads"]), int(hp["linear_num_value_heads"])
        if n_v % n_k:
            raise ConfigError(f"{path}: linear_num_value_heads ({n_v}) is not a multiple of linear_num_key_heads "
                              f"({n_k}); b11434's V-head reorder needs it. Use the config.json published with the "
                              "model.")
        if int(hp["linear_key_head_dim"]) != int(hp["linear_value_head_dim"]):
            raise UnsupportedModelError(
                f"{path}: linear_key_head_dim ({hp['linear_key_head_dim']}) differs from linear_value_head_dim "
                f"({hp['linear_value_head_dim']}); llama.cpp b11434's qwen35 loader takes both from ssm.state_size "
                "and would refuse the file. Convert it with llama.cpp's converter (--llama-cpp DIR) to see.")
        if hp.get("attn_output_gate") is False:
            raise UnsupportedModelError(f"{path}: attn_output_gate is false; llama.cpp b11434's qwen35 loader expects "
                                        "the gated query (q_proj twice the heads). Pass --target-gguf.")
        if per_expert := [n for n in self.src.tensors if _PER_EXPERT.search(n)]:
            raise NotCoveredError(
                f"{self.src.model_dir}: experts are stored one tensor each ({per_expert[0]!r}, ...); the built-in "
                "converter reads the fused mlp.experts.gate_up_proj / down_proj layout of the Qwen3.5-MoE releases. "
                "Convert it with llama.cpp's converter (--llama-cpp DIR) or pass --target-gguf.")
        if self.n_mtp() and not self.has_mtp_tensors():
            raise ConfigError(
                f"{path}: mtp_num_hidden_layers is {self.n_mtp()} but {self.src.model_dir} has no mtp.* tensors. "
                "llama.cpp b11434 would still declare the MTP layer, and its loader then stops with 'tensor "
                f"blk.{self.block_count}.attn_norm.weight not found'. Download the complete checkpoint, or set "
                "mtp_num_hidden_layers to 0 in text_config to convert it without MTP (as b11434's --no-mtp).")
        if self.drop_mtp and self.has_mtp_tensors():
            self.notes.append("MTP layer left out, as b11434's --no-mtp does")
        elif not self.n_mtp():
            self.notes.append("no MTP layer: written as b11434 writes it with --no-mtp")

    # -- tensors --------------------------------------------------------------------------------
    def skip(self, hf_name: str) -> bool:
        """b11434's filter, and with --no-mtp the MTP block (_QwenMtpMixin.filter_tensors drops ``mtp.*``)."""
        return super().skip(hf_name) or (self.drop_mtp and hf_name.startswith(("mtp.", "model.mtp.")))

    def normalise_name(self, hf_name: str) -> str:
        """ModelBase / _QwenMtpMixin.filter_tensors, then Qwen2MoeModel's and Qwen3NextModel's renames."""
        name = super().normalise_name(hf_name)
        if name.startswith("model.mtp."):
            name = name.removeprefix("model.")
        if name.startswith("mtp."):
            parts = name.split(".", 3)
            if len(parts) == 4 and parts[1] == "layers" and parts[2].isdecimal():
                name = f"model.layers.{self.block_count + int(parts[2])}.{parts[3]}"
            elif len(parts) == 3 and parts[1] in _MTP_REMAP:
                name = f"model.layers.{self.block_count}.{_MTP_REMAP[parts[1]]}.{parts[2]}"
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            name += ".weight"
        if name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        return name

    def gguf_name(self, name: str) -> str | None:
        if name.endswith(".linear_attn.A_log") and (bid := block_id(name)) is not None:
            return f"blk.{bid}.ssm_a" if name == f"model.layers.{bid}.linear_attn.A_log" else None
        return super().gguf_name(name)

    def force_f32(self, name: str) -> bool:
        # FFN_GATE_INP, FFN_GATE_INP_SHEXP and SSM_CONV1D stay F32 (ModelBase.prepare_tensors)
        return name.endswith((".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight"))

    def modify(self, spec: TensorSpec, hf_name: str) -> list[TensorSpec]:
        """_LinearAttentionVReorderBase, Qwen3NextModel and Qwen2MoeModel.modify_tensors, streamed."""
        ref, name = spec.ref, self.normalise_name(hf_name)
        assert ref is not None
        hp = self.hp
        n_k, n_v = int(hp["linear_num_key_heads"]), int(hp["linear_num_value_heads"])
        d_k, d_v = int(hp["linear_key_head_dim"]), int(hp["linear_value_head_dim"])
        reorder = n_k != n_v and "linear_attn." in name
        qk = 2 * n_k * d_k

        if name.endswith(".mlp.experts.gate_up_proj.weight"):
            return split_gate_up(spec)
        if name.endswith(".linear_attn.A_log"):
            order = _v_tiled(n_k, n_v, 1) if reorder else None
            return [replace(spec, row_order=order, transform=_neg_exp(ref.dtype))]
        if name.endswith(".linear_attn.dt_proj.bias") or ".in_proj_a." in name or ".in_proj_b." in name:
            return [replace(spec, row_order=_v_tiled(n_k, n_v, 1))] if reorder else [spec]
        if ".linear_attn.conv1d." in name:
            shape = (ref.shape[0], int(np.prod(ref.shape[1:])))  # squeeze: [C, 1, K] -> [C, K]
            order = np.concatenate([np.arange(qk), qk + _v_tiled(n_k, n_v, d_v)]) if reorder else None
            return [TensorSpec(spec.name, shape, ref=replace(ref, shape=shape), row_order=order)]
        if ".in_proj_qkv." in name:
            order = np.concatenate([np.arange(qk), qk + _v_tiled(n_k, n_v, d_v)])
            return [replace(spec, row_order=order)] if reorder else [spec]
        if ".in_proj_z." in name:
            return [replace(spec, row_order=_v_tiled(n_k, n_v, d_v))] if reorder else [spec]
        if ".linear_attn.out_proj." in name:
            cols = _v_tiled(n_k, n_v, d_v)
            return [replace(spec, transform=lambda x: x[:, cols])] if reorder else [spec]
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            return [replace(spec, transform=_plus_one(ref.dtype))]
        return [spec]

    def expected_shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        hp = self.hp
        h, v, nh, kv = int(hp["hidden_size"]), int(hp["vocab_size"]), int(hp["num_attention_heads"]), \
            int(hp["num_key_value_heads"])
        hd = self.head_dim()
        n_k, n_v = int(hp["linear_num_key_heads"]), int(hp["linear_num_value_heads"])
        d_k, d_v, kern = int(hp["linear_key_head_dim"]), int(hp["linear_value_head_dim"]), \
            int(hp["linear_conv_kernel_dim"])
        conv = 2 * n_k * d_k + n_v * d_v
        required: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
        optional: dict[str, tuple[int, ...]] = {"output.weight": (v, h)}
        if not hp.get("tie_word_embeddings", False):
            required["output.weight"] = optional.pop("output.weight")

        def attention(b: str) -> dict[str, tuple[int, ...]]:
            return {b + "attn_q.weight": (2 * nh * hd, h), b + "attn_k.weight": (kv * hd, h),
                    b + "attn_v.weight": (kv * hd, h), b + "attn_output.weight": (h, nh * hd),
                    b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}

        def linear(b: str) -> dict[str, tuple[int, ...]]:
            return {b + "attn_qkv.weight": (conv, h), b + "attn_gate.weight": (n_v * d_v, h),
                    b + "ssm_alpha.weight": (n_v, h), b + "ssm_beta.weight": (n_v, h), b + "ssm_a": (n_v,),
                    b + "ssm_dt.bias": (n_v,), b + "ssm_conv1d.weight": (conv, 1, kern),
                    b + "ssm_norm.weight": (d_v,), b + "ssm_out.weight": (h, n_v * d_v)}

        def ffn(b: str) -> dict[str, tuple[int, ...]]:
            if not self.is_moe():
                ff = int(hp["intermediate_size"])
                return {b + "ffn_gate.weight": (ff, h), b + "ffn_up.weight": (ff, h), b + "ffn_down.weight": (h, ff)}
            e, mf, sf = int(hp["num_experts"]), int(hp["moe_intermediate_size"]), \
                int(hp["shared_expert_intermediate_size"])
            return {b + "ffn_gate_inp.weight": (e, h), b + "ffn_gate_up_exps.weight": (e, 2 * mf, h),
                    b + "ffn_down_exps.weight": (e, h, mf), b + "ffn_gate_shexp.weight": (sf, h),
                    b + "ffn_up_shexp.weight": (sf, h), b + "ffn_down_shexp.weight": (h, sf),
                    b + "ffn_gate_inp_shexp.weight": (1, h)}

        for i, rec in enumerate(self.recurrent()):
            b = f"blk.{i}."
            required.update({b + "attn_norm.weight": (h,), b + "post_attention_norm.weight": (h,)})
            required.update(linear(b) if rec else attention(b))
            required.update(ffn(b))
        for j in range(self.block_count, self.block_count + self.n_mtp()):
            b = f"blk.{j}."
            required.update({b + "attn_norm.weight": (h,), b + "post_attention_norm.weight": (h,), **attention(b),
                             **ffn(b)})
        if self.n_mtp():
            b = f"blk.{self.block_count}."
            required.update({b + "nextn.eh_proj.weight": (h, 2 * h), b + "nextn.enorm.weight": (h,),
                             b + "nextn.hnorm.weight": (h,), b + "nextn.shared_head_norm.weight": (h,)})
        return required, optional

    # -- metadata -------------------------------------------------------------------------------
    def add_hparams(self, plan: GGUFPlan, ftype: LlamaFileType) -> None:
        """TextModel, Qwen2MoeModel, _QwenMtpMixin, Qwen3NextModel, _Qwen35MRopeMixin.set_gguf_parameters."""
        hp, k = self.hp, self.key
        n_layer, n_mtp = self.block_count, self.n_mtp()
        add_text_hparams(self, plan, ftype)
        plan.add_uint32(k(Keys.LLM.BLOCK_COUNT), n_layer + n_mtp)  # the MTP layers count (keeps its place)
        if (n := hp.get("moe_intermediate_size")) is not None:
            plan.add_uint32(k(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), n)
        if (n := hp.get("shared_expert_intermediate_size")) is not None:
            plan.add_uint32(k(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH), n)
        if n_mtp:
            plan.add_uint32(k(Keys.LLM.NEXTN_PREDICT_LAYERS), n_mtp)
        plan.add_uint32(k(Keys.SSM.CONV_KERNEL), hp["linear_conv_kernel_dim"])
        plan.add_uint32(k(Keys.SSM.STATE_SIZE), hp["linear_key_head_dim"])
        plan.add_uint32(k(Keys.SSM.GROUP_COUNT), hp["linear_num_key_heads"])
        plan.add_uint32(k(Keys.SSM.TIME_STEP_RANK), hp["linear_num_value_heads"])
        plan.add_uint32(k(Keys.SSM.INNER_SIZE), hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
        if hp.get("layer_types") is not None:
            plan.add_array(k(RECURRENT_LAYERS), self.recurrent() + [False] * n_mtp)
        plan.add_uint32(k(Keys.LLM.FULL_ATTENTION_INTERVAL), hp.get("full_attention_interval", 4))
        rope = self.rope_parameters()
        plan.add_uint32(k(Keys.Rope.DIMENSION_COUNT), int(self.head_dim() * rope.get("partial_rotary_factor", 0.25)))
        if "mrope_section" not in rope:
            plan.add_array(k(Keys.Rope.DIMENSION_SECTIONS), DEFAULT_MROPE_SECTION)


FAMILY = Qwen35Family


# ---------------------------------------------------------------------------------------------- the projector
_VISUAL = "model.visual."


class Qwen35Projector(ProjectorFamily):
    """b11434's ``Qwen3VLVisionModel`` (conversion/qwen3vl.py), which converts the Qwen3.5 / 3.6 vision tower:
    projector type qwen3vl_merger, the Conv3D patch embedding split into its two temporal halves
    (``v.patch_embd.weight`` and ``.weight.1``), the merger as ``mm.0`` / ``mm.2``, deepstack mergers (Qwen3-VL
    layout; the Qwen3.5 releases list none) at their layer's index."""

    def setup(self) -> None:
        hv = self.hparams_vision
        if not isinstance(hv, dict):
            return
        if "image_size" not in hv:  # (image_size / patch_size)^2 position embeddings
            n_pos, patch = hv.get("num_position_embeddings", 2304), hv.get("patch_size", 16)
            if all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in (n_pos, patch)):
                hv["image_size"] = int(n_pos**0.5 * patch)
        hv["num_attention_heads"], hv["num_hidden_layers"] = hv.get("num_heads"), hv.get("depth")

    def keep(self, hf_name: str) -> str | None:
        """Only ``model.visual.*`` (or ``visual.*``): the language model, lm_head and MTP block are not towers."""
        name = "model." + hf_name if hf_name.startswith("visual.") else hf_name
        return name if name.startswith(_VISUAL) and "language_model." not in name else None

    def deepstack(self) -> list[int]:
        hv, depth = self.vision_cfg(), self.int_field(self.vision_cfg(), ("depth",), "vision_config")
        found = hv.get("deepstack_visual_indexes", [])
        if not (isinstance(found, list) and all(isinstance(i, int) and 0 <= i < depth for i in found)):
            raise self.refuse(f"vision_config.deepstack_visual_indexes is {found!r}, not layers of the {depth};")
        return found

    def expected(self) -> dict[str, Expect]:
        hv, w = self.vision_cfg(), "vision_config"
        h, ff, depth, ps = (self.int_field(hv, (k,), w) for k in ("hidden_size", "intermediate_size", "depth",
                                                                   "patch_size"))
        n_pos, merge, kt, chans = (self.int_field(hv, (k,), w, d) for k, d in (
            ("num_position_embeddings", 2304), ("spatial_merge_size", 2), ("temporal_patch_size", 2),
            ("in_channels", 3)))
        if kt != 2:
            raise self.refuse(f"vision_config.temporal_patch_size is {kt}; b11434 splits the patch embedding into "
                              "two temporal halves only, and")
        hm, out = h * merge * merge, self.n_embd_text
        parts: list[tuple[str, str, tuple[int, ...]]] = [
            ("merger.norm", "v.post_ln", (h,)), ("merger.linear_fc1", "mm.0", (hm, hm)),
            ("merger.linear_fc2", "mm.2", (out, hm))]
        for i in range(depth):
            parts += [(f"blocks.{i}.{hf}", f"v.blk.{i}.{name}", shape) for hf, name, shape in (
                ("norm1", "ln1", (h,)), ("norm2", "ln2", (h,)), ("attn.qkv", "attn_qkv", (3 * h, h)),
                ("attn.proj", "attn_out", (h, h)), ("mlp.linear_fc1", "ffn_up", (ff, h)),
                ("mlp.linear_fc2", "ffn_down", (h, ff)))]
        for j, idx in enumerate(self.deepstack()):
            parts += [(f"deepstack_merger_list.{j}.{hf}", f"v.deepstack.{idx}.{name}", shape) for hf, name, shape in (
                ("norm", "norm", (hm,)), ("linear_fc1", "fc1", (hm, hm)), ("linear_fc2", "fc2", (out, hm)))]
        found = {f"{_VISUAL}{hf}.{part}": Expect(f"{name}.{part}", shape if part == "weight" else shape[:1])
                 for hf, name, shape in parts for part in ("weight", "bias")}
        return {_VISUAL + "patch_embed.proj.weight": Expect("v.patch_embd.weight", (h, chans, kt, ps, ps)),
                _VISUAL + "patch_embed.proj.bias": Expect("v.patch_embd.bias", (h,)),
                _VISUAL + "pos_embed.weight": Expect("v.position_embd.weight", (n_pos, h)), **found}

    def modify(self, name: str, ref: TensorRef, expect: Expect) -> list[TensorSpec]:
        """The Conv3D kernel [C, 3, 2, p, p] as two Conv2D kernels [C, 3, p, p], one per temporal step."""
        if name != _VISUAL + "patch_embed.proj.weight":
            return super().modify(name, ref, expect)
        h, chans, kt, ps, _ = ref.shape
        first = np.arange(h * chans) * kt  # runs of p*p elements: (c, ch, t) at (c * chans + ch) * kt + t
        return [gathered(expect.gguf + suffix, ref, (h, chans, ps, ps), ps * ps, first + t)
                for t, suffix in ((0, ""), (1, ".1"))]

    def add_params(self, plan: GGUFPlan, ftype: LlamaFileType) -> None:
        super().add_params(plan, ftype)
        hv = self.vision_cfg()
        plan.add_string(Keys.Clip.PROJECTOR_TYPE, VISION.name)
        plan.add_bool(Keys.ClipVision.USE_GELU, True)
        if hv.get("spatial_merge_size") is not None:
            plan.add_uint32(Keys.ClipVision.SPATIAL_MERGE_SIZE,
                            self.int_field(hv, ("spatial_merge_size",), "vision_config"))
        text = self.src.config.get("text_config") or {}  # the text model's eps, as b11434 writes it
        plan.add_float32(Keys.ClipVision.Attention.LAYERNORM_EPS, self.float_field(text, "rms_norm_eps",
                                                                                   "text_config", 1e-6))
        flags = [False] * self.int_field(hv, ("depth",), "vision_config")
        for idx in self.deepstack():
            flags[idx] = True
        plan.add_array(Keys.ClipVision.IS_DEEPSTACK_LAYERS, flags)


# HF class -> projector (b11434 registers Qwen3VLVisionModel for the ...ForConditionalGeneration classes)
PROJECTOR = {hf: Qwen35Projector for arch in ARCHS for hf in arch.hf if hf.endswith("ForConditionalGeneration")}
