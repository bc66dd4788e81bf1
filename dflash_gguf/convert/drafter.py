"""DFlash drafter checkpoint + target dir -> one GGUF, identical to llama.cpp b11434's output.

One function, read top to bottom: read and check both configs, index and check the drafter's
tensors, plan the metadata in b11434's order, embed the target's vocabulary, then stream every
tensor into ``<out>.partial`` and rename it. Nothing is written before every check has passed.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import LlamaFileType

from .. import drafters
from .. import provenance as prov
from ..dflash_format import (
    ARCH,
    DFLASH2_TENSOR_MAP,
    EMBEDDING_TENSORS,
    TENSOR_MAP,
    DFlash2Shape,
    Keys,
    expected_shapes,
    gguf_taps,
    shape_key,
)
from ..drafters.dflash import DFlashSpec
from ..errors import ConfigError, IncompatiblePairError, InputError, TensorError, UnsupportedModelError
from ..ggufio import GGUFPlan, TensorOut
from ..ggufio.layout import GGML_QUANT_VERSION
from . import torch_zip
from .configs import TargetConfig, read_target_config
from .general import add_general
from .outtype import OUTTYPES, resolve_outtype, tensor_type
from .result import ConvertResult, finish, target_embedding_fingerprint, target_record
from .safetensors import IGNORED_SUFFIXES, TensorRef, index_checkpoint
from .tensor_io import byte_source, f32_to_bf16, patched_writer, tensor_writer
from .textmodel import add_textmodel_keys, rope_parameters
from .vocab import add_target_vocab

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _map_tensors(refs: dict[str, TensorRef], cfg: DFlashSpec, notes: list[str]) -> list[tuple[str, TensorRef]]:
    """HF names -> GGUF names in b11434's order; refuse what its DFlash loader cannot take."""
    src = cfg.path.parent
    table = {**TENSOR_MAP, **(DFLASH2_TENSOR_MAP if cfg.dflash2 else {})}
    mapped: list[tuple[str, TensorRef]] = []
    unknown: list[str] = []
    for hf_name, ref in refs.items():
        name = hf_name.removeprefix("model.")
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name.endswith(".bias"):
            raise UnsupportedModelError(
                f"{src}: tensor {hf_name!r} is an attention/projection bias. llama.cpp b11434's DFlash loader has "
                "no bias tensors, so the file would fail at load with 'wrong number of tensors'; dropping trained "
                "biases would change the model. This drafter cannot be served by llama.cpp b11434."
            )
        if name in ("d2t", "t2d"):
            raise UnsupportedModelError(
                f"{src}: tensor {hf_name!r} is a reduced draft vocabulary map. llama.cpp b11434 supports d2t only "
                "for DSpark checkpoints; its DFlash converter aborts on it ('Can not map tensor')."
            )
        if name in EMBEDDING_TENSORS:
            notes.append(f"{hf_name} kept as {EMBEDDING_TENSORS[name]} (as b11434 does): the draft will use its "
                         "own table instead of the target's")
            mapped.append((EMBEDDING_TENSORS[name], ref))
            continue
        m = _LAYER.match(name)
        key, bid = (f"layers.{{i}}.{m.group(2)}", int(m.group(1))) if m else (name, None)
        gguf_name = table.get(key)
        if gguf_name is None or (bid is not None and bid >= cfg.n_layer):
            unknown.append(hf_name)
            continue
        mapped.append((gguf_name.format(i=bid), ref))
    if unknown:
        kind = "DFlash2" if cfg.dflash2 else "DFlash1"
        raise TensorError(
            f"{src}: unsupported drafter tensor(s) {unknown[:6]}{' ...' if len(unknown) > 6 else ''}. llama.cpp "
            f"b11434's DFlash loader creates only the {kind} tensor set for this config, so a file carrying them "
            "fails at load with 'wrong number of tensors'. This drafter variant cannot be served by llama.cpp b11434."
        )
    have = {n for n, _ in mapped}
    required = {v.format(i=i): k.format(i=i) for k, v in table.items()
                for i in (range(cfg.n_layer) if "{i}" in k else [None])}
    if missing := sorted(f"{required[n]} ({n})" for n in set(required) - have):
        raise TensorError(
            f"{src}: tensor(s) missing from the checkpoint: {missing[:6]}{' ...' if len(missing) > 6 else ''} "
            f"(a {'DFlash2' if cfg.dflash2 else 'DFlash1'} drafter with {cfg.n_layer} layers has {len(required)}). "
            "llama.cpp would fail with 'check_tensor_dims: tensor ... not found'. Re-download the complete checkpoint."
        )
    return mapped


MASK_EMBEDDING = "mask_embedding.pt"  # the draft's own vector for the mask row of the target's embeddings


@dataclass(frozen=True)
class MaskRow:
    """Row ``row`` of ``token_embd`` replaced by ``raw`` (bytes in the embedding's own dtype)."""

    row: int
    raw: bytes


def _cast_row(values: torch_zip.Tensor, dtype: str) -> bytes:
    """``tensor.to(dtype)`` for one row: exact widening, round-to-nearest-even narrowing (as torch)."""
    if values.dtype == dtype:
        return values.data.tobytes()
    if values.dtype not in ("F32", "F16", "BF16", "F64"):
        raise ValueError(values.dtype)
    f32 = (values.data.astype(np.uint32) << 16).view(np.float32) if values.dtype == "BF16" else \
        values.data.astype(np.float32)
    if dtype == "BF16":
        return f32_to_bf16(f32).tobytes()
    return f32.astype(np.float16 if dtype == "F16" else np.float32).tobytes()


def _target_tensor(target_dir: Path, name: str, what: str) -> TensorRef:
    refs = index_checkpoint(target_dir)
    if name not in refs:
        raise TensorError(
            f"{target_dir}: the target has no tensor {name!r}, which the drafter's {MASK_EMBEDDING} needs ({what}); "
            "llama.cpp b11434's converter stops the same way ('Target tensor ... was not found'). Point --target at "
            "the target checkpoint with its weights.")
    return refs[name]


def _mask_embedding(drafter_dir: Path, cfg: DFlashSpec, target_dir: Path, target: TargetConfig,
                    mapped: list[tuple[str, TensorRef]]) -> tuple[list[tuple[str, TensorRef]], MaskRow]:
    """b11434 DFlashModel.generate_extra_tensors: the target's output head (unless the drafter has one) and its
    token embeddings (or the drafter's own) with the mask row replaced, written before every other tensor."""
    path = drafter_dir / MASK_EMBEDDING
    mask = torch_zip.load(path)
    if not (isinstance(mask, dict) and isinstance(mask.get("embedding"), torch_zip.Tensor)
            and isinstance(mask.get("mask_token_id"), int)):
        raise InputError(f"{path}: expected a dict with 'mask_token_id' (int) and 'embedding' (a tensor). "
                         "Re-download it from the drafter's repo.")
    mask_id, h, vocab = cfg.dflash.get("mask_token_id"), cfg.hidden_size, int(cfg.hp["vocab_size"])
    if mask_id is None or mask["mask_token_id"] != mask_id:
        raise ConfigError(f"{path}: mask_token_id {mask['mask_token_id']} does not match dflash_config.mask_token_id "
                          f"{mask_id} in {cfg.path}; llama.cpp b11434's converter refuses the pair of files too. "
                          "Use the config.json and mask_embedding.pt published together.")
    if mask["embedding"].data.shape != (h,):
        raise TensorError(f"{path}: the embedding has shape {list(mask['embedding'].data.shape)}, not [{h}] "
                          f"(hidden_size). Re-download it.")
    if not 0 <= mask_id < vocab:
        raise ConfigError(f"{path}: mask_token_id {mask_id} is outside the drafter's vocab_size {vocab}.")
    own = dict(mapped)
    extra: list[tuple[str, TensorRef]] = []
    if "output.weight" not in own:
        merged = {**target.raw, **(target.raw.get("text_config") or {})}
        head = "model.embed_tokens.weight" if merged.get("tie_word_embeddings", False) else "lm_head.weight"
        extra.append(("output.weight", _target_tensor(target_dir, head, "the output head")))
    embd = own.get("token_embd.weight") or _target_tensor(target_dir, "model.embed_tokens.weight",
                                                         "the token embeddings")
    if embd.shape != (vocab, h):
        raise IncompatiblePairError(f"{embd.path}: token embeddings {list(embd.shape)} do not match the drafter's "
                                    f"[{vocab}, {h}] (vocab_size, hidden_size). Pick the drafter made for this target.")
    extra.append(("token_embd.weight", embd))
    rest = [(n, r) for n, r in mapped if n != "token_embd.weight"]
    return [*extra, *rest], MaskRow(mask_id, _cast_row(mask["embedding"], embd.dtype))


def _check_shapes(mapped: list[tuple[str, TensorRef]], cfg: DFlashSpec) -> None:
    hp = cfg.hp
    h, f = cfg.hidden_size, int(hp["intermediate_size"])
    nh, nkv, hd = int(hp["num_attention_heads"]), int(hp["num_key_value_heads"]), int(hp["head_dim"])
    k = len(cfg.target_layer_ids)
    fc = dict(mapped)["fc.weight"]
    if fc.shape != (h, k * h):
        raise IncompatiblePairError(
            f"{cfg.path.parent}: fc.weight has shape {list(fc.shape)} but {k} taps x hidden_size {h} needs "
            f"[{h}, {k * h}]. llama.cpp would refuse it ('fc.weight has wrong shape'). target_layer_ids in "
            f"{cfg.path.name} do not belong to these weights: use the matching config.json."
        )
    v2 = cfg.dflash2
    expect = expected_shapes(hidden=h, heads=nh, kv_heads=nkv, head_dim=hd, ffn=f, n_taps=k, dflash2=None if v2 is None
                             else DFlash2Shape(v2.conv_kernel_size, v2.conv_group_size, v2.selector_rank,
                                               int(hp["vocab_size"])))
    for name, ref in mapped:
        ne = expect.get(shape_key(name)) if name != "fc.weight" else None
        want = tuple(reversed(ne)) if ne is not None else None
        if ref.dtype not in ("BF16", "F16", "F32"):
            raise TensorError(f"{ref.path}: tensor {ref.name!r} has dtype {ref.dtype}; DFlash drafters are "
                              "BF16/F16/F32 checkpoints. Quantized or FP8 drafters are not supported.")
        if want is not None and ref.shape != want:
            raise TensorError(
                f"{ref.path}: tensor {ref.name!r} has shape {list(ref.shape)}, but config.json (hidden_size {h}, "
                f"heads {nh}/{nkv}, head_dim {hd}, intermediate_size {f}) implies {list(want)}. The config and "
                "weights do not belong together: re-download the checkpoint."
            )


def _add_hparams(plan: GGUFPlan, cfg: DFlashSpec, target: TargetConfig, ftype: LlamaFileType) -> None:
    """The keys of TextModel.set_gguf_parameters + DFlashModel.set_gguf_parameters, in their order."""
    hp = cfg.hp
    add_textmodel_keys(plan, ARCH, hp, ftype)  # DFlashModel derives from TextModel (via Qwen3Model)
    rope = rope_parameters(hp)

    dflash = cfg.dflash
    if (prf := rope.get("partial_rotary_factor")) is not None:
        plan.add_uint32(Keys.ROPE_DIMENSION_COUNT, int(hp["head_dim"] * prf))
    if (value_scale := dflash.get("attention_value_scale")) is not None:
        plan.add_float32(Keys.VALUE_SCALE, value_scale)
    plan.add_uint32(Keys.BLOCK_SIZE, cfg.block_size)
    if (v2 := cfg.dflash2) is not None:
        plan.add_uint32(Keys.CONV_KERNEL_SIZE, v2.conv_kernel_size)
        plan.add_uint32(Keys.CONV_GROUP_SIZE, v2.conv_group_size)
        plan.add_uint32(Keys.SELECTOR_RANK, v2.selector_rank)
        plan.add_uint32(Keys.SELECTOR_TOP_K, v2.selector_top_k)
    if (mult := dflash.get("output_multiplier", cfg.raw.get("output_multiplier"))) is not None:
        plan.add_float32(Keys.LOGIT_SCALE, mult)
    softcap = dflash.get("final_logit_softcapping", cfg.raw.get("final_logit_softcapping"))
    if softcap is not None and float(softcap) > 0:
        plan.add_float32(Keys.FINAL_LOGIT_SOFTCAPPING, softcap)
    scale = dflash.get("input_embedding_scale", cfg.raw.get("input_embedding_scale"))
    if scale is None and target.is_gemma:
        scale = target.hidden_size ** 0.5  # Gemma scales its embeddings by sqrt(H) in the forward pass
    if scale is not None:
        plan.add_float32(Keys.EMBEDDING_SCALE, scale)
    plan.add_array(Keys.TARGET_LAYERS, gguf_taps(cfg.target_layer_ids))
    if cfg.sliding_window and cfg.swa_pattern:
        plan.add_uint32(Keys.SLIDING_WINDOW, cfg.sliding_window)
        plan.add_array(Keys.SLIDING_WINDOW_PATTERN, list(cfg.swa_pattern))
    if cfg.causal is not None:
        plan.add_bool(Keys.CAUSAL, cfg.causal)
    if target.uses_mrope:
        plan.add_array(Keys.ROPE_DIMENSION_SECTIONS, [int(hp["head_dim"]) // 2, 0, 0, 0])


def convert_drafter(
    drafter_dir: Path,
    target_dir: Path,
    outfile: Path,
    outtype: str = "auto",
    *,
    tokenizer_dir: Path | None = None,
    provenance: dict[str, str] | None = None,
    quant: str | None = None,
    dry_run: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Convert a DFlash drafter for llama.cpp b11434.

    ``tokenizer_dir`` (default: ``target_dir``) is where the target's tokenizer files are read, so a
    repaired overlay can stand in for a read-only snapshot. ``provenance`` adds our own keys. ``quant``
    ("q4_0", "q8_0", ...) quantizes in the same pass, giving the bytes of converting to ``outtype`` and
    then running llama-quantize, with no intermediate file.

    Raises:
        ConfigError, UnsupportedModelError, TensorError, IncompatiblePairError, TokenizerError,
        InputError, OutputError: each with a message naming the file, the field and the fix.
    """
    start = time.perf_counter()
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    reading = drafters.interpret_folder(drafter_dir)
    cfg = reading.require()
    for finding in reading.findings:
        if finding.note and finding.severity == "warning":
            log.warning("%s: %s", cfg.path, finding.message)
    target = read_target_config(target_dir)
    target_rules = drafters.target_findings(target.facts())
    drafters.first_error((*target_rules, *drafters.pair_findings(reading, target.facts())))
    notes = [*reading.notes, *(f.message for f in target_rules if f.note)]
    mapped = _map_tensors(index_checkpoint(drafter_dir), cfg, notes)
    _check_shapes(mapped, cfg)
    patch: MaskRow | None = None
    if (drafter_dir / MASK_EMBEDDING).is_file():
        mapped, patch = _mask_embedding(drafter_dir, cfg, target_dir, target, mapped)
    outtype = resolve_outtype(outtype, (ref for _, ref in mapped))
    ftype, qtype = OUTTYPES[outtype]

    plan = GGUFPlan(ARCH)
    add_general(plan, (provenance or {}).get(prov.DRAFTER_REPO) or drafter_dir.name, drafter_dir)
    for name, ref in mapped:
        tq = tensor_type(name, ref.shape, qtype)
        if patch is not None and name == "token_embd.weight":
            plan.add_tensor(TensorOut(name, tuple(reversed(ref.shape)), tq, patched_writer(ref, tq, patch.row,
                                                                                          patch.raw)))
            continue
        plan.add_tensor(TensorOut(name, tuple(reversed(ref.shape)), tq, tensor_writer(ref, tq),
                                  byte_source(ref, tq)))
    _add_hparams(plan, cfg, target, ftype)
    plan.add_uint32(Keys.QUANTIZATION_VERSION, GGML_QUANT_VERSION)
    vocab = add_target_vocab(plan, tokenizer_dir or target_dir, target, int(cfg.hp["vocab_size"]))
    if cfg.mask_token_id >= vocab.n_tokens:
        raise IncompatiblePairError(
            f"Drafter {cfg.path} has mask_token_id {cfg.mask_token_id}, outside the {vocab.n_tokens}-token vocabulary "
            f"of target {target_dir}. llama.cpp would abort on the first draft. Pick the drafter made for this target."
        )
    plan.add_uint32(Keys.MASK_TOKEN_ID, cfg.mask_token_id)

    recorded = target_record(target_dir, target.path, target.arch, vocab.sha256,
                             {prov.DRAFTER_SOURCE: str(drafter_dir), **(provenance or {})})
    return finish(plan, Path(outfile), outtype, vocab, tuple(notes), recorded, start, quant=quant, dry_run=dry_run,
                  on_progress=on_progress)


__all__ = ["OUTTYPES", "ConvertResult", "convert_drafter", "target_embedding_fingerprint"]
