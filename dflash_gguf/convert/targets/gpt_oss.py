"""gpt-oss targets (openai/gpt-oss-20b, gpt-oss-120b), as b11434's ``GptOssModel`` (conversion/gpt_oss.py) writes
them: GGUF architecture ``gpt-oss`` (llama.cpp's ``LLM_ARCH_OPENAI_MOE``).

Keys: b11434 reads the config through transformers' ``GptOssConfig`` (defaults below) and writes
``TextModel.set_gguf_parameters``' generic keys (yarn rope scaling, ``expert_count`` from num_local_experts,
``key_length``/``value_length`` from head_dim), then ``attention.sliding_window`` and
``expert_feed_forward_length`` (intermediate_size). Nothing records ``layer_types``: b11434's loader fixes the
pattern (``load_swa_pattern(ml, 2)``: even layers sliding), nor ``swiglu_limit`` (its graph hard-codes 7.0).
With ``quantization_config.quant_method`` ``mxfp4`` and an f32/f16/bf16 outtype, ``general.file_type`` is
``MOSTLY_MXFP4_MOE`` (ModelBase.prepare_metadata).

Tensors:

* the MXFP4 experts (``mlp.experts.{gate_up,down}_proj_{blocks,scales}``, uint8) are written first, before any
  other tensor and as MXFP4 whatever the outtype (``generate_extra_tensors`` -> ``repack_mxfp4``): per 32-value
  block, the E8M0 scale byte, then the 16 code bytes in ggml's order (byte j holds values j and j+16; the
  checkpoint's byte i holds values 2i and 2i+1, ``transform_nibble_layout``). ``gate_up_proj`` rows are
  interleaved: even rows are ``ffn_gate_exps``, odd rows ``ffn_up_exps`` (gate written first); ``down_proj`` is
  ``ffn_down_exps``. Each layer's three tensors appear where its ``*_scales`` are read (down, then gate, up);
* the BF16 re-release's experts (``gate_up_proj`` ``[E, h, 2*ff]``, ``down_proj`` ``[E, ff, h]``) are transposed
  to ``[E, 2*ff, h]`` / ``[E, h, ff]`` and, for gate_up, split into even / odd rows, then follow the outtype;
* ``gate_up_proj_bias`` is split into even / odd columns (``ffn_gate_exps.bias``, ``ffn_up_exps.bias``),
  ``down_proj_bias`` is ``ffn_down_exps.bias``; the router ``mlp.router`` is ``ffn_gate_inp`` (weight F32 whatever
  the outtype), ``self_attn.sinks`` ``attn_sinks.weight``, ``post_attention_layernorm`` ``post_attention_norm``.

Vocabulary: ``GptOssModel.set_vocab`` -> ``_set_vocab_gpt2`` (the o200k regex: b11434 lists it as ``gpt-4o``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any, BinaryIO

import numpy as np
from gguf import GGMLQuantizationType, Keys, LlamaFileType

from ...errors import TensorError, UnsupportedModelError
from ...ggufio import GGUFPlan
from ...tensor_names import TEXT_MODEL, block_map
from ..configs import TargetArch
from ..safetensors import TensorRef
from ..tensor_io import read_tensor_bytes
from .base import TensorSpec, TextFamily, add_text_hparams
from .experts import check_config_fields, check_expert_counts

# GptOssModel.set_vocab: _set_vocab_gpt2
ARCH = TargetArch("gpt-oss", ("GptOssForCausalLM",), True, "gpt2", graph="openai-moe.cpp", output_tap=True)
ARCHS = (ARCH,)

# transformers 4.57.6 GptOssConfig.__init__ defaults (what AutoConfig(...).to_dict() gives b11434 for a field
# config.json lacks).
GPT_OSS_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "rope_theta": 150000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "attention_dropout": 0.0, "num_experts_per_tok": 4, "router_aux_loss_coef": 0.9, "output_router_logits": False,
    "use_cache": True, "layer_types": None,
}
SWIGLU_LIMIT = 7.0  # src/llama-graph.cpp of b11434, LLM_FFN_SWIGLU_OAI_MOE

# Normalised HF name -> GGUF name; b11434 gguf-py tensor_mapping.py entries of MODEL_ARCH.GPT_OSS.
# ``ffn_gate_up_exps`` is a planning name only: it is split before anything is written.
TENSOR_MAP = {
    **TEXT_MODEL,
    **block_map({
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.sinks": "attn_sinks",
        "mlp.router": "ffn_gate_inp",
        "mlp.experts.gate_up_proj": "ffn_gate_up_exps",
        "mlp.experts.down_proj": "ffn_down_exps",
    }),
}
_MXFP4_KINDS = ("gate_up_proj", "down_proj")
_BLOCK_BYTES = 16  # FP4 codes of one 32-value block


def gpt_oss_hparams(raw: dict[str, Any]) -> dict[str, Any]:
    """A gpt-oss config.json as transformers 4.57.6's ``GptOssConfig(...).to_dict()`` gives it to b11434."""
    hp = {**GPT_OSS_DEFAULTS, **raw}
    if hp.get("head_dim") is None and hp.get("hidden_size") and hp.get("num_attention_heads"):
        hp["head_dim"] = int(hp["hidden_size"]) // int(hp["num_attention_heads"])
    if hp.get("num_key_value_heads") is None:
        hp["num_key_value_heads"] = hp["num_attention_heads"]
    if hp.get("layer_types") is None and isinstance(hp.get("num_hidden_layers"), int):
        hp["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                             for i in range(hp["num_hidden_layers"])]
    if isinstance(hp.get("rope_scaling"), dict) and "type" in hp["rope_scaling"]:
        hp["rope_scaling"] = {**hp["rope_scaling"], "rope_type": hp["rope_scaling"]["type"]}
    return hp


def repack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """b11434's ``repack_mxfp4`` for whole rows: ``blocks`` ``[..., n, 16]`` and E8M0 ``scales`` ``[..., n]`` (uint8)
    -> ggml ``block_mxfp4`` bytes ``[..., n, 17]``: the scale, then byte j = value j (low nibble) and value j+16
    (high nibble), where the checkpoint's byte i holds value 2i (low) and 2i+1 (high)."""
    first, second = blocks[..., :8], blocks[..., 8:]  # byte i: values 2i, 2i+1 (first), 16+2i, 17+2i (second)
    out = np.empty((*blocks.shape[:-1], 1 + _BLOCK_BYTES), dtype=np.uint8)
    out[..., 0] = scales
    out[..., 1::2] = (first & 0x0F) | ((second & 0x0F) << 4)  # code byte 2i: values 2i and 16+2i
    out[..., 2::2] = (first >> 4) | (second & 0xF0)  # code byte 2i+1: values 2i+1 and 17+2i
    return out


def _whatever_type(write: Callable[[BinaryIO], object]) -> Callable[[GGMLQuantizationType],
                                                                  Callable[[BinaryIO], object]]:
    """A ``TensorSpec.writer`` for bytes already in their ggml type (``raw_type``): the same, whatever the outtype."""
    return lambda _qtype: write


def mxfp4_writer(blocks: TensorRef, scales: TensorRef, rows: slice) -> Callable[[BinaryIO], object]:
    """Streams one repacked MXFP4 expert tensor, one expert at a time: the rows ``rows`` (every row, or gate_up's
    even / odd ones) of every expert."""
    n_exp, n_rows, n_blk = blocks.shape[0], blocks.shape[1], blocks.shape[2]
    b_bytes, s_bytes = n_rows * n_blk * _BLOCK_BYTES, n_rows * n_blk

    def write(out: BinaryIO) -> None:
        with open(blocks.path, "rb", buffering=0) as fb, open(scales.path, "rb", buffering=0) as fs:
            for e in range(n_exp):
                b = np.frombuffer(read_tensor_bytes(fb.fileno(), blocks, b_bytes, e * b_bytes), dtype=np.uint8)
                s = np.frombuffer(read_tensor_bytes(fs.fileno(), scales, s_bytes, e * s_bytes), dtype=np.uint8)
                b = b.reshape(n_rows, n_blk, _BLOCK_BYTES)[rows]
                s = s.reshape(n_rows, n_blk)[rows]
                out.write(repack_mxfp4(b, s).tobytes())

    return write


def _every_other(start: int, n: int) -> Callable[[np.ndarray], np.ndarray]:
    """Columns ``start, start+2, ...`` of rows of ``n`` values (the fused bias split, ``[..., start::2]``)."""
    return lambda x: x.reshape(-1, n)[:, start::2]


def _transposed(rows: int, cols: int, start: int = 0, step: int = 1) -> Callable[[np.ndarray], np.ndarray]:
    """Whole experts ``[rows, cols]`` -> ``[cols, rows]`` (``transpose(-1, -2)``), keeping rows ``start::step`` of
    the result (gate_up's even / odd rows)."""
    return lambda x: x.reshape(-1, rows, cols)[:, :, start::step].transpose(0, 2, 1)


class GptOssFamily(TextFamily):
    gguf_arch = ARCH.gguf
    tensor_map = TENSOR_MAP

    @classmethod
    def load_hparams(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return gpt_oss_hparams(raw)

    @property
    def n_experts(self) -> int:
        return int(self.hp["num_local_experts"])

    @property
    def quant_method(self) -> Any:
        return (self.hp.get("quantization_config") or {}).get("quant_method")

    @cached_property
    def mxfp4(self) -> bool:
        """The checkpoint's experts are MXFP4 blocks and scales (openai's release), not BF16 tensors."""
        return any(".mlp.experts." in n and n.endswith(("_blocks", "_scales")) for n in self.src.tensors)

    @cached_property
    def mxfp4_names(self) -> dict[str, tuple[int, str, str]]:
        """HF name of every MXFP4 tensor the model has -> (layer, projection, blocks or scales)."""
        return {f"model.layers.{i}.mlp.experts.{kind}_{part}": (i, kind, part)
                for i in range(self.block_count) for kind in _MXFP4_KINDS for part in ("blocks", "scales")}

    def check_config(self) -> None:
        """Refuse what b11434's converter stops on or its gpt-oss loader cannot load, before any tensor is read."""
        path, hp = self.src.config.path, self.hp
        check_config_fields(path, hp, ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                       "vocab_size", "num_local_experts", "num_experts_per_tok", "intermediate_size",
                                       "sliding_window"), "gpt-oss")
        check_expert_counts(path, self.n_experts, int(hp["num_experts_per_tok"]), "num_local_experts")
        if self.mxfp4:
            for key in ("hidden_size", "intermediate_size"):
                if int(hp[key]) % 32:
                    raise UnsupportedModelError(
                        f"{path}: {key} is {hp[key]}, not a multiple of 32, but the experts are MXFP4 (blocks of "
                        "32 values along each row). Such a checkpoint cannot be repacked for llama.cpp; use the "
                        "config.json published with the weights.")
        layer_types = hp.get("layer_types") or []
        fixed = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.block_count)]
        if list(layer_types) != fixed:
            self.notes.append("layer_types is not gpt-oss's alternating pattern (even layers sliding), but llama.cpp "
                              "b11434's gpt-oss loader always uses that pattern: outputs will differ from "
                              "transformers'")
        if (limit := hp.get("swiglu_limit")) is not None and float(limit) != SWIGLU_LIMIT:
            self.notes.append(f"swiglu_limit is {limit}, but llama.cpp b11434's gpt-oss graph always clamps at "
                              f"{SWIGLU_LIMIT}: outputs will differ from transformers'")

    # -- tensors --------------------------------------------------------------------------------
    def skip(self, hf_name: str) -> bool:
        """The MXFP4 tensors are written by :meth:`extra_tensors`, not in the checkpoint loop."""
        return hf_name in self.mxfp4_names or super().skip(hf_name)

    def normalise_name(self, hf_name: str) -> str:
        """GptOssModel.filter_tensors (``sinks`` + ``.weight``) and modify_tensors' renames of the experts."""
        name = super().normalise_name(hf_name)
        if "sinks" in name:
            name += ".weight"
        for kind in _MXFP4_KINDS:
            if name.endswith(f".mlp.experts.{kind}_bias"):
                return name.removesuffix("_bias") + ".bias"
            if name.endswith(f".mlp.experts.{kind}"):
                return name + ".weight"
        return name

    def extra_tensors(self) -> list[TensorSpec]:
        """GptOssModel.generate_extra_tensors: the MXFP4 experts repacked, where each ``*_scales`` is read."""
        if not self.mxfp4:
            return []
        tensors, order = self.src.tensors, {n: k for k, n in enumerate(self.src.tensors)}
        h, ff = int(self.hp["hidden_size"]), int(self.hp["intermediate_size"])
        shapes = {"gate_up_proj": (2 * ff, h), "down_proj": (h, ff)}
        if missing := [n for n in self.mxfp4_names if n not in tensors]:
            more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
            raise TensorError(
                f"{self.src.model_dir}: MXFP4 expert tensor(s) missing from the checkpoint: {missing[:6]}{more}, "
                f"required by {self.src.config.path.name} ({self.block_count} layers). Download the complete "
                "checkpoint (every shard of model.safetensors.index.json).")
        specs: list[TensorSpec] = []
        for hf_name in tensors:
            if (what := self.mxfp4_names.get(hf_name)) is None or what[2] != "scales":
                continue
            bid, kind, _ = what
            blocks, scales = tensors[hf_name.removesuffix("_scales") + "_blocks"], tensors[hf_name]
            rows, cols = shapes[kind]
            for ref, want in ((blocks, (self.n_experts, rows, cols // 32, _BLOCK_BYTES)),
                              (scales, (self.n_experts, rows, cols // 32))):
                if ref.dtype != "U8" or tuple(ref.shape) != want:
                    raise TensorError(
                        f"{ref.path}: tensor {ref.name!r} is {ref.dtype} {list(ref.shape)}, but an MXFP4 expert "
                        f"tensor of {self.src.config.path} is U8 {list(want)}. The config and the weights do not "
                        "belong together: re-download the checkpoint (config.json and every shard from the same "
                        "revision).")
            if order[blocks.name] > order[hf_name]:
                raise TensorError(
                    f"{scales.path}: {scales.name!r} is read before {blocks.name!r}; llama.cpp b11434's converter "
                    "pairs each *_scales with the *_blocks read before it and would write the wrong blocks. "
                    "Re-download the checkpoint as published (its shards sorted so blocks come first).")
            b = f"blk.{bid}."
            outs = ([(b + "ffn_down_exps.weight", slice(None))] if kind == "down_proj" else
                    [(b + "ffn_gate_exps.weight", slice(0, None, 2)), (b + "ffn_up_exps.weight", slice(1, None, 2))])
            for name, sel in outs:
                n_rows = len(range(rows)[sel])
                specs.append(TensorSpec(name, (self.n_experts, n_rows, cols), ref=blocks,
                                        raw_type=GGMLQuantizationType.MXFP4, scales=(scales,),
                                        writer=_whatever_type(mxfp4_writer(blocks, scales, sel))))
        return specs

    def modify(self, spec: TensorSpec, hf_name: str) -> list[TensorSpec]:
        """GptOssModel.modify_tensors: BF16 experts transposed, the fused gate_up weight and bias split."""
        ref = spec.ref
        assert ref is not None
        stem = spec.name.removesuffix("gate_up_exps.weight").removesuffix("gate_up_exps.bias")
        if spec.name.endswith("ffn_gate_up_exps.bias"):
            n_exp, two_ff = ref.shape
            return [TensorSpec(stem + f"{kind}_exps.bias", (n_exp, two_ff // 2), ref=ref,
                               transform=_every_other(start, two_ff)) for start, kind in ((0, "gate"), (1, "up"))]
        if spec.name.endswith("ffn_gate_up_exps.weight"):
            n_exp, h, two_ff = ref.shape
            return [TensorSpec(stem + f"{kind}_exps.weight", (n_exp, two_ff // 2, h), ref=ref,
                               transform=_transposed(h, two_ff, start, 2)) for start, kind in ((0, "gate"), (1, "up"))]
        if spec.name.endswith("ffn_down_exps.weight"):
            n_exp, ff, h = ref.shape
            return [TensorSpec(spec.name, (n_exp, h, ff), ref=ref, transform=_transposed(ff, h))]
        return [spec]

    def force_f32(self, name: str) -> bool:
        return name.endswith(".ffn_gate_inp.weight")  # FFN_GATE_INP (ModelBase.prepare_tensors)

    def expected_shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        hp = self.hp
        h, v, nh = int(hp["hidden_size"]), int(hp["vocab_size"]), int(hp["num_attention_heads"])
        kv, hd = int(hp["num_key_value_heads"]), int(hp["head_dim"])
        e, ff = self.n_experts, int(hp["intermediate_size"])
        required: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
        optional: dict[str, tuple[int, ...]] = {"output.weight": (v, h)}
        for i in range(self.block_count):
            b = f"blk.{i}."
            required.update({
                b + "attn_norm.weight": (h,), b + "post_attention_norm.weight": (h,),
                b + "attn_q.weight": (nh * hd, h), b + "attn_q.bias": (nh * hd,),
                b + "attn_k.weight": (kv * hd, h), b + "attn_k.bias": (kv * hd,),
                b + "attn_v.weight": (kv * hd, h), b + "attn_v.bias": (kv * hd,),
                b + "attn_output.weight": (h, nh * hd), b + "attn_output.bias": (h,),
                b + "attn_sinks.weight": (nh,),
                b + "ffn_gate_inp.weight": (e, h), b + "ffn_gate_inp.bias": (e,),
                b + "ffn_gate_up_exps.bias": (e, 2 * ff), b + "ffn_down_exps.bias": (e, h),
            })
            if not self.mxfp4:  # transformers' GptOssExperts layout
                required.update({b + "ffn_gate_up_exps.weight": (e, h, 2 * ff), b + "ffn_down_exps.weight": (e, ff, h)})
        if not hp.get("tie_word_embeddings", False):
            required["output.weight"] = optional.pop("output.weight")
        return required, optional

    # -- metadata -------------------------------------------------------------------------------
    def add_hparams(self, plan: GGUFPlan, ftype: LlamaFileType) -> None:
        """TextModel (``general.file_type`` as prepare_metadata relabels it), then GptOssModel.set_gguf_parameters."""
        if self.quant_method == "mxfp4" and ftype in (LlamaFileType.ALL_F32, LlamaFileType.MOSTLY_F16,
                                                      LlamaFileType.MOSTLY_BF16):
            ftype = LlamaFileType.MOSTLY_MXFP4_MOE
        add_text_hparams(self, plan, ftype)
        plan.add_uint32(self.key(Keys.Attention.SLIDING_WINDOW), int(self.hp["sliding_window"]))
        plan.add_uint32(self.key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), int(self.hp["intermediate_size"]))


FAMILY = GptOssFamily
