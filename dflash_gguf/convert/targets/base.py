"""What every target family shares: the source checkpoint, the tensor plan, and b11434's ``TextModel``.

A family (one module per architecture family, see the package docstring) subclasses :class:`TextFamily`
and overrides the hooks where its b11434 class overrides ``TextModel``. Defaults here follow b11434's
``conversion/base.py``: ``TextModel.filter_tensors`` (multimodal towers skipped, ``language_model.``
dropped), ``TextModel.set_gguf_parameters`` (the generic keys, in their order) and ``set_vocab``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from ...ggufio import GGUFPlan
from ..configs import TargetConfig
from ..safetensors import IGNORED_SUFFIXES, TensorRef
from ..textmodel import add_textmodel_keys, find_hparam, rope_parameters
from ..vocab import VocabInfo, add_target_vocab

# Substrings / prefixes b11434's TextModel.filter_tensors drops: vision, audio and projector towers.
_MULTIMODAL_PREFIXES = ("mlp", "vit.", "vpm.", "siglip2.", "conformer.", "merger.", "resampler.", "sound_encoder.",
                        "sound_projection.", "speech_embeddings.")
_MULTIMODAL_PARTS = ("visual.", "vision.", "audio.", "talker.", "vision_", "audio_", "token2wav.", "code2wav.",
                     "projector.", "pre_mm_projector_norm", "image_newline", "view_seperator", "patch_embed",
                     "patch_embedding", "patch_merger.", "patch_merge_mlp.", "model.connector.")
# Buffers b11434's prepare_tensors never writes.
_BLOCK = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class TargetSource:
    """One target checkpoint as b11434 sees it."""

    model_dir: Path
    tok_dir: Path  # tokenizer files (an overlay may stand in for a read-only snapshot)
    config: TargetConfig  # config.json, read raw (arch, raw dict)
    hparams: dict[str, Any]  # b11434's self.hparams: config (+ transformers defaults) with text_config on top
    tensors: dict[str, TensorRef]  # every checkpoint tensor, in b11434's order (shards sorted, names sorted)


@dataclass(frozen=True)
class TensorSpec:
    """One output tensor. ``shape`` is PyTorch order (the GGUF ``ne`` is its reverse).

    Exactly one of ``ref`` (bytes in the checkpoint) or ``data`` (a small generated F32 array) is set.
    ``row_order`` permutes whole rows (output row r is source row ``row_order[r]``, e.g. Llama's q/k
    permutation) and ``transform`` maps F32 values chunk by chunk (whole rows); both are streamed.
    ``parts``: the tensor is these checkpoint tensors stacked along a new first axis (b11434's
    ``torch.stack`` of one-tensor-per-expert weights), written one after the other; ``ref`` is then the
    first part, which stands for their dtype (``--outtype auto``).
    ``writer``: the family's own streaming writer for the output type (FP8 weights dequantized block by block,
    gpt-oss's repacked MXFP4 experts); it replaces the generic ones, and ``ref`` / ``parts`` then only say what is
    read (read-ahead, ``--outtype auto``), with ``scales``. ``raw_type``: the tensor is that ggml type whatever the
    outtype (b11434's ``add_tensor(..., raw_dtype=...)``), its ``writer`` streaming those bytes.
    """

    name: str
    shape: tuple[int, ...]
    ref: TensorRef | None = None
    data: np.ndarray | None = None
    row_order: np.ndarray | None = None
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    force_f32: bool = False
    parts: tuple[TensorRef, ...] = ()
    writer: Callable[[GGMLQuantizationType], Callable[[BinaryIO], object]] | None = None
    raw_type: GGMLQuantizationType | None = None
    scales: tuple[TensorRef, ...] = ()  # what ``writer`` reads besides ``ref`` / ``parts`` (block scales)

    @property
    def sources(self) -> tuple[TensorRef, ...]:
        """Every checkpoint tensor the writer reads."""
        return (*(self.parts or ((self.ref,) if self.ref is not None else ())), *self.scales)

    @property
    def read_paths(self) -> tuple[Path, ...]:
        """The files those live in (what a writer waits for while they stream in: ``arrivals``)."""
        return tuple(dict.fromkeys(ref.path for ref in self.sources))


def block_id(name: str) -> int | None:
    """b11434's ``bid``: the first dot-separated number in the tensor name."""
    m = _BLOCK.search(f".{name}.")
    return int(m.group(1)) if m else None


def attention_shapes(b: str, h: int, nh: int, kv: int, hd: int, q_norm: int, k_norm: int
                     ) -> dict[str, tuple[int, ...]]:
    """A grouped-query attention block's norms and projections (``b``: ``blk.N.``), with q/k norms ``q_norm`` and
    ``k_norm`` wide (a head, or the whole projection), as the Qwen3-style converters write them."""
    return {b + "attn_norm.weight": (h,), b + "attn_q.weight": (nh * hd, h), b + "attn_k.weight": (kv * hd, h),
            b + "attn_v.weight": (kv * hd, h), b + "attn_output.weight": (h, nh * hd),
            b + "attn_q_norm.weight": (q_norm,), b + "attn_k_norm.weight": (k_norm,), b + "ffn_norm.weight": (h,)}


def trimmed_rows(ref: TensorRef, n_rows: int) -> TensorRef:
    """The first ``n_rows`` rows of a tensor (a prefix of its bytes: nothing is read or copied here)."""
    n_rows = min(n_rows, ref.shape[0])
    row_bytes = ref.nbytes // ref.shape[0]
    return TensorRef(ref.name, ref.dtype, (n_rows, *ref.shape[1:]), ref.path, ref.offset, n_rows * row_bytes)


@dataclass
class TextFamily:
    """b11434's ``TextModel`` for one target; subclasses override what their b11434 class overrides.

    Class attributes a family sets: ``gguf_arch`` (general.architecture) and ``tensor_map`` (HF name
    after :meth:`normalise_name`, with ``{bid}`` for the block -> GGUF name without ``.weight``).
    """

    gguf_arch: ClassVar[str]
    tensor_map: ClassVar[dict[str, str]] = {}

    src: TargetSource
    notes: list[str] = field(default_factory=list)
    drop_mtp: bool = False  # b11434's --no-mtp: leave a multi-token-prediction head out (families that have one)

    # -- config ---------------------------------------------------------------------------------
    @classmethod
    def load_hparams(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """b11434's ``self.hparams``: config.json (as ``AutoConfig`` returns it, or raw when transformers
        4.57.6 does not know the model) with ``text_config`` moved to the root (TextModel.__init__)."""
        return {**raw, **(raw.get("text_config") or {})}

    @property
    def hp(self) -> dict[str, Any]:
        return self.src.hparams

    @property
    def block_count(self) -> int:
        return int(self.find_hparam(("n_layers", "num_hidden_layers", "n_layer", "num_layers")))

    def find_hparam(self, keys: tuple[str, ...], optional: bool = False) -> Any:
        return find_hparam(self.hp, keys, optional)

    def check_config(self) -> None:
        """Refuse configs the family cannot convert exactly (ConfigError / UnsupportedModelError)."""

    def rope_parameters(self) -> dict[str, Any]:
        return rope_parameters(self.hp)

    # -- tensors --------------------------------------------------------------------------------
    def skip(self, hf_name: str) -> bool:
        """Tensors b11434 leaves out of a text model (TextModel.filter_tensors) or never writes."""
        return (hf_name.startswith(_MULTIMODAL_PREFIXES) or any(p in hf_name for p in _MULTIMODAL_PARTS)
                or hf_name.endswith(IGNORED_SUFFIXES))

    def normalise_name(self, hf_name: str) -> str:
        """The name b11434 maps (ModelBase.filter_tensors drops ``language_model.``)."""
        return hf_name.replace("language_model.", "")

    def gguf_name(self, name: str) -> str | None:
        """GGUF name of a normalised HF tensor name; None when the family has no such tensor."""
        for suffix in (".weight", ".bias"):
            if not name.endswith(suffix):
                continue
            stem, bid = name[: -len(suffix)], block_id(name)
            key = stem.replace(f".{bid}.", ".{bid}.", 1) if bid is not None else stem
            if (mapped := self.tensor_map.get(key)) is not None:
                return mapped.format(bid=bid) + suffix
        return None

    def extra_tensors(self) -> list[TensorSpec]:
        """Generated tensors written before the checkpoint's (b11434 generate_extra_tensors)."""
        return []

    def modify(self, spec: TensorSpec, hf_name: str) -> list[TensorSpec]:
        """b11434 modify_tensors for one mapped tensor (trim rows, permute, shift values...)."""
        return [spec]

    def expected_shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """(required, optional) GGUF name -> HF (PyTorch-order) shape implied by the config."""
        raise NotImplementedError

    def force_f32(self, name: str) -> bool:
        """Tensors b11434 keeps in F32 whatever the outtype (FFN_GATE_INP, POS_EMBD, ...)."""
        return False

    def dequantizes(self, hf_name: str) -> bool:
        """A checkpoint tensor stored in a type the generic writers do not read (e.g. FP8) that the family decodes
        itself, through :attr:`TensorSpec.writer`, as b11434's ``dequant_model`` does."""
        return False

    # -- metadata -------------------------------------------------------------------------------
    def key(self, template: str) -> str:
        return template.format(arch=self.gguf_arch)

    def add_hparams(self, plan: GGUFPlan, ftype: LlamaFileType) -> None:
        """TextModel.set_gguf_parameters: the generic keys, in b11434's order."""
        add_text_hparams(self, plan, ftype)

    def vocab_size(self) -> int | None:
        v = self.hp.get("vocab_size")
        return None if v is None else int(v)

    def add_vocab(self, plan: GGUFPlan) -> VocabInfo:
        """set_vocab; by default the target-vocabulary code the drafter converter embeds."""
        return add_target_vocab(plan, self.src.tok_dir, self.src.config, self.vocab_size() or 0)


def add_text_hparams(fam: TextFamily, plan: GGUFPlan, ftype: LlamaFileType) -> None:
    """The keys of b11434 ``TextModel.set_gguf_parameters`` for a family, in order (its ``super()`` call)."""
    add_textmodel_keys(plan, fam.gguf_arch, fam.hp, ftype)
