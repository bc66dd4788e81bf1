"""MiniMax-M2 targets (MiniMax-M2, M2.1, M2.5, M2.7), as b11434's ``MiniMaxM2Model`` (conversion/minimax.py) writes
them, FP8 weights dequantized as ``ModelBase.dequant_model`` (conversion/base.py) does.

Keys: ``TextModel.set_gguf_parameters``' generic keys from the raw config.json (transformers 4.57.6 has no
``minimax_m2`` config, so b11434 falls back to the file): ``feed_forward_length`` and, after the file type,
``expert_feed_forward_length`` both from intermediate_size (the experts' width: the model has no dense MLP),
``expert_count`` (num_local_experts), ``expert_used_count``, ``expert_gating_func`` (scoring_func, sigmoid),
``key_length`` / ``value_length`` (head_dim), then ``rope.dimension_count`` from rotary_dim (partial RoPE: 64 of
128). Nothing records use_routing_bias or the MTP modules (an MTP tensor in a checkpoint is refused as unknown:
b11434 cannot map one either).

Tensors, in the checkpoint's sorted order: ``block_sparse_moe.e_score_correction_bias`` -> ``exp_probs_b.bias``
(renamed ``e_score_correction.bias`` by ``ModelBase.filter_tensors``; F32), the experts
``block_sparse_moe.experts.{e}.w{1,2,3}.weight`` stacked by index into ``ffn_gate_exps`` (w1), ``ffn_down_exps``
(w2), ``ffn_up_exps`` (w3), in that order, where the layer's last-read expert tensor stands, the router
``block_sparse_moe.gate`` -> ``ffn_gate_inp`` (F32), the norms, and the attention with its q/k RMS norms over the
full projection width (``attn_q_norm`` [heads * head_dim], ``attn_k_norm`` [kv_heads * head_dim], as the
minimax-m2 loader creates them).

FP8: with ``quantization_config.quant_method`` "fp8", every ``X_scale_inv`` is dropped and ``X`` (float8 e4m3fn)
becomes ``X.float() * scale`` with ``scale`` the float32 block scales repeated ``weight_block_size`` times along each
axis and cut to the weight's shape (edge blocks partial): one float32 multiplication per element, then the output
type. :func:`decode_e4m3` decodes exactly (subnormals, +-448, and the NaN bytes 0x7F / 0xFF as the float32 NaN
torch gives them); :func:`fp8_writer` streams whole block rows, so a tensor is never held in memory at once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cached_property
from typing import BinaryIO

import numpy as np
from gguf import GGMLQuantizationType, Keys, LlamaFileType

from ...errors import ConfigError, TensorError, UnsupportedModelError
from ...ggufio import GGUFPlan
from ...tensor_names import DECODER_BLOCK, QK_NORM, TEXT_MODEL, block_map
from ..configs import TargetArch
from ..safetensors import TensorRef
from ..tensor_io import CHUNK_BYTES, encode, read_tensor_bytes, to_f32
from ..textmodel import add_textmodel_keys
from .base import TensorSpec, TextFamily, add_text_hparams, attention_shapes, block_id
from .experts import check_config_fields, check_expert_counts, expert_part_name, expert_shapes

# MiniMaxM2Model.set_vocab is TextModel's (GPT-2 BPE)
ARCH = TargetArch("minimax-m2", ("MiniMaxM2ForCausalLM",), True, "gpt2", graph="minimax-m2.cpp")
ARCHS = (ARCH,)

# Normalised HF name -> GGUF name (b11434 gguf-py tensor_mapping.py entries used by MODEL_ARCH.MINIMAXM2).
TENSOR_MAP = {
    **TEXT_MODEL,
    **block_map({k: v for k, v in DECODER_BLOCK.items() if not k.startswith("mlp.")} | QK_NORM),
    **block_map({"block_sparse_moe.gate": "ffn_gate_inp", "block_sparse_moe.e_score_correction": "exp_probs_b"}),
}
# One expert's projection; w1 gate, w2 down, w3 up (tensor_mapping.py's block_sparse_moe.experts.w{1,2,3}).
_PER_EXPERT = re.compile(r"^(?P<stem>.+\.block_sparse_moe\.experts)\.(?P<expert>\d+)\.(?P<w>w[123])\.weight$")
_KIND = {"w1": "gate", "w2": "down", "w3": "up"}
_STACK_ORDER = ("w1", "w2", "w3")  # the w_name loop of MiniMaxM2Model.modify_tensors
_SCALE = "_scale_inv"
# scoring_func -> b11434's gguf.ExpertGatingFuncType (SQRTSOFTPLUS is 4 there; older gguf-py lacks it)
_GATING = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}
_SCORE_KEYS = ("score_function", "scoring_func", "score_func", "moe_router_activation", "moe_router_activation_func",
               "expert_selection_fn")


# ----------------------------------------------------------------------------------------------- FP8


def _e4m3_table() -> np.ndarray:
    """float32 value of every float8 e4m3fn byte (1 sign, 4 exponent bits biased 7, 3 mantissa bits; no infinity;
    S.1111.111 is NaN, with the float32 bits torch's conversion gives it: sign | 0x7FF00000)."""
    b = np.arange(256, dtype=np.uint32)
    exp, mant = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    mag = np.where(exp == 0, mant / 8.0 * 2.0 ** -6, (1.0 + mant / 8.0) * np.exp2(exp.astype(np.float64) - 7.0))
    out = np.where(b & 0x80, -mag, mag).astype(np.float32)  # every value is exact in float32
    bits = out.view(np.uint32)
    nan = (b & 0x7F) == 0x7F
    bits[nan] = (b[nan] & 0x80) << 24 | 0x7FF00000
    return out


E4M3 = _e4m3_table()


def decode_e4m3(raw: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """float8 e4m3fn bytes -> float32, exactly (torch's ``tensor.float()``)."""
    return E4M3[np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.view(np.uint8)]


def dequantize_rows(raw: bytes, scale: np.ndarray, first_row: int, cols: int, block: tuple[int, int]) -> np.ndarray:
    """Rows ``first_row..`` of an FP8 weight times their block scales, in float32 (``dequant_simple``): each
    element's scale is ``scale[row // block_rows, col // block_cols]``."""
    w = decode_e4m3(raw).reshape(-1, cols)
    rows = np.arange(first_row, first_row + w.shape[0]) // block[0]
    s = scale[rows][:, np.arange(cols) // block[1]]
    return w * s


def fp8_writer(weights: tuple[TensorRef, ...], scales: tuple[TensorRef, ...], block: tuple[int, int]
               ) -> Callable[[GGMLQuantizationType], Callable[[BinaryIO], object]]:
    """The :attr:`TensorSpec.writer` of FP8 weights (one, or the experts of a stack, written in turn): each
    dequantized in bounded chunks of whole block rows and encoded as the output type."""

    def for_type(qtype: GGMLQuantizationType) -> Callable[[BinaryIO], object]:
        def write(out: BinaryIO) -> None:
            for ref, sref in zip(weights, scales, strict=True):
                rows, cols = ref.shape
                with open(sref.path, "rb", buffering=0) as f:
                    scale = to_f32(read_tensor_bytes(f.fileno(), sref, sref.nbytes), sref.dtype).reshape(sref.shape)
                step = max(1, CHUNK_BYTES // (4 * cols * block[0])) * block[0]
                with open(ref.path, "rb", buffering=0) as f:
                    for start in range(0, rows, step):
                        n = min(step, rows - start)
                        raw = read_tensor_bytes(f.fileno(), ref, n * cols, start * cols)
                        x = dequantize_rows(raw, scale, start, cols, block)
                        out.write(encode(x.reshape(-1), qtype, cols).tobytes())

        return write

    return for_type


# ------------------------------------------------------------------------------------------- family


class MiniMaxM2Family(TextFamily):
    gguf_arch = ARCH.gguf
    tensor_map = TENSOR_MAP

    @property
    def n_experts(self) -> int:
        return int(self.find_hparam(("num_local_experts", "num_experts")))

    def head_dim(self) -> int:
        hd = self.hp.get("head_dim")
        return int(hd) if hd is not None else int(self.hp["hidden_size"]) // int(self.hp["num_attention_heads"])

    @cached_property
    def fp8_block(self) -> tuple[int, int] | None:
        """``weight_block_size`` when the checkpoint is FP8 (quant_method "fp8"), else None."""
        qc = self.hp.get("quantization_config")
        if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
            return None
        bs = qc.get("weight_block_size")
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(x, int) and x > 0 for x in bs)):
            raise UnsupportedModelError(
                f"{self.src.config.path}: quantization_config.weight_block_size is {bs!r}; the built-in converter "
                "dequantizes FP8 weights with 2-D block scales (the MiniMax-M2 releases: [128, 128]). Convert it with "
                "llama.cpp's converter (--llama-cpp DIR) or pass --target-gguf.")
        return bs[0], bs[1]

    @cached_property
    def experts(self) -> dict[str, tuple[str, int, str]]:
        """HF name of each per-expert tensor -> (layer stem, expert, w1/w2/w3)."""
        return {n: (m["stem"], int(m["expert"]), m["w"]) for n in self.src.tensors
                if (m := _PER_EXPERT.match(self.normalise_name(n))) is not None}

    @cached_property
    def stack_at(self) -> dict[str, str]:
        """HF name of each layer's last-read expert tensor -> the layer's experts stem (b11434 writes the stacks
        when its cache holds all 3 * E of them)."""
        last: dict[str, str] = {}
        for hf_name, (stem, _, _) in self.experts.items():
            last[stem] = hf_name
        return {hf_name: stem for stem, hf_name in last.items()}

    def check_config(self) -> None:
        path, hp = self.src.config.path, self.hp
        check_config_fields(path, hp, ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                                       "num_local_experts", "num_experts_per_tok", "intermediate_size", "rotary_dim"),
                            "MiniMax-M2")
        check_expert_counts(path, self.n_experts, int(hp["num_experts_per_tok"]), "num_local_experts")
        score = self.find_hparam(_SCORE_KEYS, optional=True)
        if score is not None and score not in _GATING:
            raise ConfigError(f"{path}: scoring_func is {score!r}; b11434's converter stops on it (sigmoid, softmax "
                              "or sqrtsoftplus). Use the config.json published with the model.")
        fp8 = [n for n, r in self.src.tensors.items() if r.dtype in ("F8_E4M3", "F8_E5M2")]
        if fp8 and self.fp8_block is None:
            raise UnsupportedModelError(
                f"{path}: tensor(s) {fp8[:3]} are FP8 but config.json has no quantization_config with quant_method "
                "'fp8', so nothing says how to scale them. Use the config.json published with the checkpoint.")
        scaled = [n.removesuffix(_SCALE) for n in self.src.tensors if n.endswith(_SCALE)] if self.fp8_block else []
        if odd := [n for n in scaled if n not in self.src.tensors or self.src.tensors[n].dtype != "F8_E4M3"
                   or len(self.src.tensors[n].shape) != 2]:
            raise TensorError(f"{self.src.model_dir}: block scales {[n + _SCALE for n in odd[:3]]} belong to no 2-D "
                              "float8 e4m3 weight of the checkpoint (b11434's dequant_model would stop or scale a "
                              "float weight). Re-download the checkpoint.")
        if bad := [n for n in fp8 if self.src.tensors[n].dtype != "F8_E4M3"]:
            raise UnsupportedModelError(f"{path}: tensor(s) {bad[:3]} are float8 e5m2; the built-in converter decodes "
                                        "float8 e4m3fn (the MiniMax-M2 releases). Use llama.cpp's converter "
                                        "(--llama-cpp DIR).")

    # -- tensors --------------------------------------------------------------------------------
    def skip(self, hf_name: str) -> bool:
        """dequant_model drops the scales (and the unused activation scales) of an FP8 checkpoint."""
        if self.fp8_block is not None and hf_name.endswith((_SCALE, ".activation_scale", "_activation_scale")):
            return True
        return super().skip(hf_name)

    def normalise_name(self, hf_name: str) -> str:
        """ModelBase.filter_tensors: ``e_score_correction_bias`` -> ``e_score_correction.bias``."""
        name = super().normalise_name(hf_name)
        return name[: -len("e_score_correction_bias")] + "e_score_correction.bias" if name.endswith(
            "e_score_correction_bias") else name

    def gguf_name(self, name: str) -> str | None:
        if (m := _PER_EXPERT.match(name)) is not None:
            bid = block_id(name)
            assert bid is not None
            return expert_part_name(bid, _KIND[m["w"]], int(m["expert"]))
        return super().gguf_name(name)

    def dequantizes(self, hf_name: str) -> bool:
        ref = self.src.tensors[hf_name]
        return (ref.dtype == "F8_E4M3" and self.fp8_block is not None and len(ref.shape) == 2
                and hf_name + _SCALE in self.src.tensors)

    def _scale(self, ref: TensorRef) -> TensorRef:
        """The block scales of an FP8 weight, checked against its shape."""
        sref = self.src.tensors[ref.name + _SCALE]
        assert self.fp8_block is not None
        want = tuple(-(-d // b) for d, b in zip(ref.shape, self.fp8_block, strict=True))
        if tuple(sref.shape) != want or sref.dtype not in ("BF16", "F16", "F32"):
            raise TensorError(f"{sref.path}: {sref.name!r} is {sref.dtype} {list(sref.shape)}, but the FP8 weight "
                              f"{list(ref.shape)} with {list(self.fp8_block)} blocks needs float scales {list(want)}. "
                              "Re-download the checkpoint.")
        return sref

    def _fp8(self, spec: TensorSpec, refs: tuple[TensorRef, ...]) -> TensorSpec:
        """``spec`` written through :func:`fp8_writer` when its tensors are FP8 (all of a stack are, or none)."""
        if self.fp8_block is None or not all(r.dtype == "F8_E4M3" and r.name + _SCALE in self.src.tensors
                                             for r in refs):
            if any(r.dtype not in ("BF16", "F16", "F32") for r in refs):
                bad = next(r for r in refs if r.dtype not in ("BF16", "F16", "F32"))
                raise TensorError(f"{bad.path}: tensor {bad.name!r} is {bad.dtype} without its {bad.name}{_SCALE} "
                                  "block scales; b11434 cannot dequantize it. Re-download the checkpoint.")
            return spec
        scales = tuple(self._scale(r) for r in refs)
        return TensorSpec(spec.name, spec.shape, ref=spec.ref, parts=spec.parts, scales=scales,
                          writer=fp8_writer(refs, scales, self.fp8_block))

    def modify(self, spec: TensorSpec, hf_name: str) -> list[TensorSpec]:
        """MiniMaxM2Model.modify_tensors: a layer's experts stacked once all are read; FP8 weights dequantized."""
        if hf_name in self.experts:
            stem = self.stack_at.get(hf_name)
            if stem is None:
                return []
            bid = block_id(stem)
            out = []
            for w in _STACK_ORDER:
                names = [f"{stem}.{e}.{w}.weight" for e in range(self.n_experts)]
                if any(n not in self.src.tensors for n in names):
                    return []  # the missing-tensor check names the expert
                parts = tuple(self.src.tensors[n] for n in names)
                stacked = TensorSpec(f"blk.{bid}.ffn_{_KIND[w]}_exps.weight", (self.n_experts, *parts[0].shape),
                                     ref=parts[0], parts=parts)
                out.append(self._fp8(stacked, parts))
            return out
        assert spec.ref is not None
        return [self._fp8(spec, (spec.ref,))]

    def force_f32(self, name: str) -> bool:
        return name.endswith(".ffn_gate_inp.weight")  # FFN_GATE_INP (ModelBase.prepare_tensors)

    def expected_shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        hp = self.hp
        h, v, nh = int(hp["hidden_size"]), int(hp["vocab_size"]), int(hp["num_attention_heads"])
        kv, hd = int(hp["num_key_value_heads"]), self.head_dim()
        e, mf = self.n_experts, int(hp["intermediate_size"])
        required: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,),
                                                "output.weight": (v, h)}
        for i in range(self.block_count):
            b = f"blk.{i}."
            required.update({
                **attention_shapes(b, h, nh, kv, hd, nh * hd, kv * hd),  # full-width q/k norms
                b + "ffn_gate_inp.weight": (e, h), b + "exp_probs_b.bias": (e,),
                **expert_shapes(i, e, {"gate": (mf, h), "up": (mf, h), "down": (h, mf)}),
            })
        return required, {}

    # -- metadata -------------------------------------------------------------------------------
    def add_hparams(self, plan: GGUFPlan, ftype: LlamaFileType) -> None:
        """TextModel.set_gguf_parameters (its expert_gating_func from scoring_func included), then
        MiniMaxM2Model's expert_feed_forward_length and rope.dimension_count."""
        score = self.find_hparam(_SCORE_KEYS, optional=True)
        if score is None:
            add_text_hparams(self, plan, ftype)
        else:
            # The shared TextModel keys refuse a gating function (dense families only); write them without it and
            # put expert_gating_func where TextModel writes it: before key/value_length and the file type.
            hp = {k: v for k, v in self.hp.items() if k not in _SCORE_KEYS}
            add_textmodel_keys(plan, self.gguf_arch, hp, ftype)
            moved = [self.key(Keys.Attention.KEY_LENGTH), self.key(Keys.Attention.VALUE_LENGTH), Keys.General.FILE_TYPE]
            tail = {k: plan.kv.pop(k) for k in moved if k in plan.kv}
            plan.add_uint32(self.key(Keys.LLM.EXPERT_GATING_FUNC), _GATING[score])
            plan.kv.update(tail)
        plan.add_uint32(self.key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), self.hp["intermediate_size"])
        plan.add_uint32(self.key(Keys.Rope.DIMENSION_COUNT), self.hp["rotary_dim"])


FAMILY = MiniMaxM2Family
