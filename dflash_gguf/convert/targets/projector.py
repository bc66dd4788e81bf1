"""Multimodal projector ("mmproj") files: what every family's projector shares, as b11434's ``MmprojModel``
(conversion/base.py) and ``ModelBase.prepare_tensors`` write them for ``convert_hf_to_gguf.py --mmproj``.

A projector is a second GGUF beside the text model (``general.architecture`` "clip", ``general.type`` "mmproj")
holding the vision and/or audio towers that the text conversion leaves out. A family module exposes
``PROJECTOR`` (HF ``architectures[0]`` -> a :class:`ProjectorFamily` subclass); the registry
(``convert.targets``) finds it and runs :func:`plan_projector` and :func:`build_projector_plan`.

A family lists every checkpoint tensor its towers may hold, by the name the released checkpoints use
(:meth:`ProjectorFamily.expected`), with the GGUF name, the shape its config implies and whether it is required:
anything else, a missing required tensor or a wrong shape is refused before a byte is written, where b11434 would
stop half-way ("Can not map tensor") or write a file llama.cpp's clip loader rejects.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, Keys, LlamaFileType

from ...errors import ConfigError, InputError, TensorError
from ...ggufio import GGUFPlan, TensorOut
from ...ggufio.layout import GGML_QUANT_VERSION
from ...jsonfile import read_json
from ..general import sampling_defaults
from ..outtype import OUTTYPES, resolve_outtype
from ..safetensors import IGNORED_SUFFIXES, TensorRef
from ..tensor_io import CHUNK_BYTES, encode, read_tensor_bytes, to_f32
from .base import TensorSpec
from .writers import spec_writer

F32, F16 = GGMLQuantizationType.F32, GGMLQuantizationType.F16
CLIP_ARCH = "clip"  # gguf-py MODEL_ARCH.MMPROJ's name
# read in this order, the second winning, each with the section b11434 lifts to the top level
PREPROCESSOR_FILES = (("preprocessor_config.json", "media_proc_cfg"), ("processor_config.json", "image_processor"))
# MmprojModel's key lists: the first key a sub-config has is used (find_vparam / find_aparam).
BLOCK_KEYS = ("n_layers", "num_hidden_layers", "n_layer", "num_layers", "depth", "layers", "encoder_layers",
              "vt_num_hidden_layers")
_VISION_KEYS = (
    (Keys.ClipVision.IMAGE_SIZE, ("image_size",)),
    (Keys.ClipVision.PATCH_SIZE, ("patch_size",)),
    (Keys.ClipVision.EMBEDDING_LENGTH, ("hidden_size", "width", "vt_hidden_size")),
    (Keys.ClipVision.FEED_FORWARD_LENGTH, ("intermediate_size", "vt_intermediate_size")),
    (Keys.ClipVision.BLOCK_COUNT, BLOCK_KEYS),
    (Keys.ClipVision.Attention.HEAD_COUNT, ("num_attention_heads", "num_heads", "heads", "vt_num_attention_heads")),
)
_AUDIO_KEYS = (
    (Keys.ClipAudio.EMBEDDING_LENGTH, ("hidden_size",)),
    (Keys.ClipAudio.FEED_FORWARD_LENGTH, ("intermediate_size",)),
    (Keys.ClipAudio.BLOCK_COUNT, BLOCK_KEYS),
    (Keys.ClipAudio.Attention.HEAD_COUNT, ("num_attention_heads",)),
)
# Tensors prepare_tensors keeps in F32 whatever the outtype, by GGUF name (V_ENC_EMBD_POS, A_ENC_EMBD_POS).
_ALWAYS_F32 = ("v.position_embd.weight", "a.position_embd.weight")


@dataclass(frozen=True)
class Expect:
    """One checkpoint tensor a projector may hold: its GGUF name and the (PyTorch-order) shape its config implies."""

    gguf: str
    shape: tuple[int, ...]
    required: bool = True


@dataclass(frozen=True)
class ProjectorSource:
    """A target checkpoint as b11434's ``MmprojModel`` sees it: config.json read raw (transformers 4.57.6 does not
    know the Gemma-4 and Qwen3.5 model types, so b11434 falls back to the file), every tensor in b11434's order."""

    model_dir: Path
    config_path: Path
    arch: str  # the HF class that picked the projector
    config: dict[str, Any]
    tensors: dict[str, TensorRef]


def read_preprocessor_config(model_dir: Path) -> dict[str, Any]:
    """MmprojModel's ``preprocessor_config``: preprocessor_config.json (``media_proc_cfg`` lifted to the top), then
    processor_config.json (``image_processor`` lifted) merged over it; {} when neither exists.

    Raises:
        InputError: a file that exists is not a JSON object (or its nested section is not one).
    """
    merged: dict[str, Any] = {}
    for name, nested in PREPROCESSOR_FILES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        cfg = read_json(path)
        if not isinstance(cfg, dict) or (nested in cfg and not isinstance(cfg[nested], dict)):
            raise InputError(f"{path} is not a JSON object with '{nested}' an object, as llama.cpp b11434 reads it. "
                             "Re-download it from the model's repository.")
        merged = {**merged, **cfg, **cfg.get(nested, {})}
    return merged


class ProjectorFamily:
    """b11434's ``MmprojModel`` for one target; a family's projector class overrides what its b11434 class does.

    ``setup`` is the b11434 class's ``__init__`` (renaming sub-config fields), ``check_config`` its refusals,
    ``keep`` its ``filter_tensors``, ``expected`` and ``modify`` its ``modify_tensors``, ``force_type`` its
    ``tensor_force_quant``, ``add_params`` its ``set_gguf_parameters`` (call ``super()`` first, as b11434 does).
    """

    has_vision: ClassVar[bool] = True  # MmprojModel.has_vision_encoder / has_audio_encoder (class defaults)
    has_audio: ClassVar[bool] = False

    def __init__(self, src: ProjectorSource) -> None:
        self.src = src
        self.notes: list[str] = []
        cfg = src.config
        text = {**cfg, **(cfg.get("text_config") or {})}
        self.n_embd_text = text.get("hidden_size", text.get("n_embd", 0))
        audio_key = "whisper_config" if "whisper_config" in cfg else "audio_config"
        self.hparams_vision: dict[str, Any] | None = copy.deepcopy(cfg.get("vision_config"))
        # MmprojModel adds an empty audio_config when the file has none (so hparams_audio is {} then, not None)
        self.hparams_audio: dict[str, Any] | None = copy.deepcopy(cfg.get(audio_key, {}))
        self.vision, self.audio = self.has_vision, self.has_audio
        self.preprocessor = read_preprocessor_config(src.model_dir)
        self.setup()

    # -- config ---------------------------------------------------------------------------------
    def setup(self) -> None:
        """The b11434 class's ``__init__`` after MmprojModel's: sub-config fields renamed or filled in."""

    def refuse(self, what: str) -> ConfigError:
        return ConfigError(f"{self.src.config_path}: {what} llama.cpp b11434's --mmproj conversion of "
                           f"{self.src.arch} needs it. Use the config.json published with the model.")

    def vision_cfg(self) -> dict[str, Any]:
        if not isinstance(self.hparams_vision, dict):
            raise self.refuse("'vision_config' is missing or not an object;")
        return self.hparams_vision

    def audio_cfg(self) -> dict[str, Any]:
        if not isinstance(self.hparams_audio, dict):
            raise self.refuse("'audio_config' is missing or not an object;")
        return self.hparams_audio

    def int_field(self, cfg: dict[str, Any], keys: tuple[str, ...], where: str, default: int | None = None) -> int:
        """The first of ``keys`` in ``cfg`` as a non-negative int (``default`` when none is there)."""
        key = next((k for k in keys if k in cfg), None)
        value = cfg[key] if key is not None else default
        if key is None and default is None:
            raise self.refuse(f"{where} has no '{' / '.join(keys)}';")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.refuse(f"{where}.{key} is {value!r}, not a size;")
        return value

    def float_field(self, cfg: dict[str, Any], key: str, where: str, default: float) -> float:
        value = cfg.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.refuse(f"{where}.{key} is {value!r}, not a number;")
        return float(value)

    def image_stats(self) -> tuple[list[float], list[float]]:
        """image_mean and image_std from the preprocessor files; refused unless llama.cpp's clip loader can read
        them (an array of at least 3 F32: b11434 writes JSON integers as an INT32 array, which it rejects)."""
        out = []
        for key in ("image_mean", "image_std"):
            value = self.preprocessor.get(key)
            files = " or ".join(str(self.src.model_dir / f) for f, _ in reversed(PREPROCESSOR_FILES))
            if value is None:
                raise ConfigError(
                    f"{files}: no '{key}' (at the top level, or under 'image_processor' in processor_config.json). "
                    "llama.cpp b11434 writes the image normalisation into the projector and stops with a KeyError "
                    "without it. Download the processor_config.json / preprocessor_config.json published with "
                    "the model.")
            if not (isinstance(value, list) and len(value) >= 3 and all(type(v) is float for v in value)):
                raise ConfigError(
                    f"{files}: '{key}' is {value!r}; llama.cpp's clip loader needs at least 3 floats (written as "
                    "0.5, not 0 or 1: integers become an INT32 array it rejects). Use the file published with the "
                    "model.")
            out.append(value)
        return out[0], out[1]

    def check_config(self) -> None:
        """Refusals before any tensor is read (ConfigError): what set_gguf_parameters and the shapes need."""
        if not isinstance(self.n_embd_text, int) or self.n_embd_text <= 0:
            raise self.refuse("text_config.hidden_size is missing or not a size ('n_embd not found');")
        if self.vision:
            self.image_stats()
        scratch = GGUFPlan(CLIP_ARCH)
        self.add_params(scratch, LlamaFileType.MOSTLY_F16)  # every key set_gguf_parameters writes can be written
        self.expected()

    # -- tensors --------------------------------------------------------------------------------
    def keep(self, hf_name: str) -> str | None:
        """filter_tensors: the name the tower tensor is known by in :meth:`expected`, or None when it is not one."""
        return None if "language_model." in hf_name else hf_name

    def expected(self) -> dict[str, Expect]:
        """Every tower tensor the config implies, by (kept) checkpoint name."""
        raise NotImplementedError

    def modify(self, name: str, ref: TensorRef, expect: Expect) -> list[TensorSpec]:
        """modify_tensors for one tensor (a 0-d scalar becomes 1-d, as b11434's ``unsqueeze(0)``)."""
        if not ref.shape:
            ref = TensorRef(ref.name, ref.dtype, (1,), ref.path, ref.offset, ref.nbytes)
        return [TensorSpec(expect.gguf, ref.shape, ref=ref)]

    def force_type(self, name: str, gguf_name: str, ftype: LlamaFileType) -> GGMLQuantizationType | None:
        """tensor_force_quant: MmprojModel keeps patch embeddings F16 under f16 and F32 otherwise."""
        if ".patch_embd.weight" in gguf_name or ".patch_merger.weight" in gguf_name:
            return F16 if ftype == LlamaFileType.MOSTLY_F16 else F32
        return None

    # -- metadata -------------------------------------------------------------------------------
    def add_params(self, plan: GGUFPlan, ftype: LlamaFileType) -> None:
        """MmprojModel.set_gguf_parameters: file type, then the vision keys, then the audio keys."""
        plan.add_uint32(Keys.General.FILE_TYPE, ftype)
        if self.vision:
            hv = self.vision_cfg()
            plan.add_bool(Keys.Clip.HAS_VISION_ENCODER, True)
            plan.add_uint32(Keys.ClipVision.PROJECTION_DIM, self.n_embd_text)
            for key, names in _VISION_KEYS:
                plan.add_uint32(key, self.int_field(hv, names, "vision_config"))
            mean, std = self.image_stats()
            plan.add_array(Keys.ClipVision.IMAGE_MEAN, mean, GGUFValueType.FLOAT32)
            plan.add_array(Keys.ClipVision.IMAGE_STD, std, GGUFValueType.FLOAT32)
        if self.audio:
            ha = self.audio_cfg()
            plan.add_bool(Keys.Clip.HAS_AUDIO_ENCODER, True)
            plan.add_uint32(Keys.ClipAudio.PROJECTION_DIM, self.n_embd_text)
            for key, names in _AUDIO_KEYS:
                plan.add_uint32(key, self.int_field(ha, names, "audio_config"))
        if not (self.vision or self.audio):
            raise self.refuse("neither a vision nor an audio encoder is described;")


def tensor_type(fam: ProjectorFamily, name: str, spec: TensorSpec, ftype: LlamaFileType,
                qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """prepare_tensors' choice for one projector tensor (``name``: its kept checkpoint name)."""
    forced = fam.force_type(name, spec.name, ftype)
    if len(spec.shape) <= 1 or spec.name.endswith("_norm.weight"):
        return F32
    if forced is not None:
        return forced
    if spec.name in _ALWAYS_F32 or not spec.name.endswith(".weight"):
        return F32
    if qtype == GGMLQuantizationType.Q8_0 and spec.shape[-1] % 32:
        return F16  # gguf-py's QuantError fallback, as b11434 logs it
    return qtype


def plan_projector(fam: ProjectorFamily) -> tuple[list[tuple[str, TensorSpec]], list[TensorRef]]:
    """(kept name, output tensor) in b11434's order, and the kept checkpoint tensors (``--outtype auto`` looks at
    them); unknown, missing, mis-shaped or non-float tower tensors refused first.

    Raises:
        TensorError: each problem named with the tensor, the file and the fix.
    """
    src, expected = fam.src, fam.expected()
    specs: list[tuple[str, TensorSpec]] = []
    kept: list[TensorRef] = []
    unknown: list[str] = []
    seen: set[str] = set()
    for hf_name, ref in src.tensors.items():
        name = fam.keep(hf_name)
        if name is None:
            continue
        kept.append(ref)
        if hf_name.endswith(IGNORED_SUFFIXES):
            continue
        want = expected.get(name)
        if want is None:
            unknown.append(hf_name)
            continue
        if ref.dtype not in ("BF16", "F16", "F32"):
            raise TensorError(f"{ref.path}: tensor {hf_name!r} has dtype {ref.dtype}; the built-in converter reads "
                              "BF16/F16/F32 towers. Convert the projector with llama.cpp's converter (--mmproj).")
        if tuple(ref.shape) != want.shape:
            raise TensorError(
                f"{ref.path}: tensor {hf_name!r} has shape {list(ref.shape)}, but {src.config_path} implies "
                f"{list(want.shape)}. The config and the weights do not belong together: re-download the checkpoint "
                "(config.json and every shard from the same revision).")
        seen.add(name)
        specs.extend((name, spec) for spec in fam.modify(name, ref, want))
    if unknown:
        more = f" and {len(unknown) - 6} more" if len(unknown) > 6 else ""
        raise TensorError(
            f"{src.model_dir}: tensor(s) {unknown[:6]}{more} are not part of the {src.arch} towers as "
            f"{src.config_path.name} describes them. llama.cpp b11434's --mmproj conversion would stop with 'Can not "
            "map tensor' or write a projector its clip loader rejects. Check that config.json and the weights come "
            "from the same model, or convert the projector with llama.cpp's converter.")
    if missing := [n for n, e in expected.items() if e.required and n not in seen]:
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise TensorError(
            f"{src.model_dir}: tower tensor(s) missing from the checkpoint: {missing[:6]}{more}, required by "
            f"{src.config_path.name}. llama.cpp's clip loader would stop with 'unable to find tensor'. Download the "
            "complete checkpoint (every shard of model.safetensors.index.json).")
    return specs, kept


def build_projector_plan(fam: ProjectorFamily, outtype: str, name: str,
                         planned: tuple[list[tuple[str, TensorSpec]], list[TensorRef]]) -> tuple[GGUFPlan, str]:
    """Every key and tensor of the projector in b11434's order (no provenance keys): (plan, outtype resolved)."""
    specs, kept = planned
    outtype = resolve_outtype(outtype, kept)  # the first 2-D tower tensor in BF16/F16 decides, else f16
    ftype, qtype = OUTTYPES[outtype]
    plan = GGUFPlan(CLIP_ARCH)
    plan.add_string(Keys.General.TYPE, "mmproj")
    for key, (vtype, value) in sampling_defaults(fam.src.model_dir).items():
        if vtype == GGUFValueType.STRING:
            plan.add_string(key, str(value))
        else:
            plan.add(key, vtype, int(value) if vtype == GGUFValueType.INT32 else float(value))
    plan.add_string(Keys.General.NAME, name)
    for kept_name, spec in specs:
        tq = tensor_type(fam, kept_name, spec, ftype, qtype)
        write, source = spec_writer(spec, tq)
        plan.add_tensor(TensorOut(spec.name, tuple(reversed(spec.shape)), tq, write, source, spec.read_paths))
    fam.add_params(plan, ftype)
    plan.add_uint32(Keys.General.QUANTIZATION_VERSION, GGML_QUANT_VERSION)
    return plan, outtype


# -- streamed layouts ---------------------------------------------------------------------------------------------
def gathered(name: str, ref: TensorRef, shape: tuple[int, ...], unit: int, order: np.ndarray) -> TensorSpec:
    """Output tensor ``name`` of ``shape``: the source's runs of ``unit`` elements taken in ``order`` (a slice along
    a middle axis, an axis swap), read and converted a bounded chunk at a time. ``unit`` holds whole output rows."""
    elem = ref.nbytes // max(1, int(np.prod(ref.shape, dtype=np.int64)))
    per_chunk = max(1, CHUNK_BYTES // (unit * elem))
    row = shape[-1] if shape else 1

    def writer(qtype: GGMLQuantizationType) -> Callable[[BinaryIO], object]:
        def write(out: BinaryIO) -> None:
            with open(ref.path, "rb", buffering=0) as f:
                for start in range(0, len(order), per_chunk):
                    raw = b"".join(read_tensor_bytes(f.fileno(), ref, unit * elem, int(u) * unit * elem)
                                   for u in order[start:start + per_chunk])
                    out.write(encode(to_f32(raw, ref.dtype), qtype, row).tobytes())
        return write

    return TensorSpec(name, shape, ref=ref, writer=writer)


def softplus(dtype: str) -> Callable[[np.ndarray], np.ndarray]:
    """torch's ``softplus`` (threshold 20) rounded once from float64; on an F16 source the result is rounded to F16
    first, as b11434 computes it in the checkpoint's half type. torch's vectorised exp/log1p are not correctly
    rounded, so a value may sit one ulp from b11434's (the parity test allows exactly that, for this tensor)."""
    def apply(x: np.ndarray) -> np.ndarray:
        y = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20).astype(np.float64)))).astype(np.float32)
        return y.astype(np.float16).astype(np.float32) if dtype == "F16" else y
    return apply


def patch_columns(p: int) -> np.ndarray:
    """Column order turning a flattened (row, col, channel) patch into (channel, row, col), as ggml's im2col reads
    it: output column ``i`` is source column ``perm[i]``."""
    i = np.arange(p * p * 3)
    ch, row, col = i // (p * p), (i % (p * p)) // p, i % p
    return row * p * 3 + col * 3 + ch
