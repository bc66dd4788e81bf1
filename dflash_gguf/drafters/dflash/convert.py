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
from gguf import GGMLQuantizationType, LlamaFileType

from ... import drafters
from ... import provenance as prov
from ...convert import torch_zip
from ...convert.configs import TargetConfig
from ...convert.general import add_general
from ...convert.outtype import OUTTYPES, resolve_outtype, tensor_type
from ...convert.result import ConvertResult, drafter_card_record, finish, target_embedding_fingerprint, target_record
from ...convert.safetensors import IGNORED_SUFFIXES, TensorRef, index_checkpoint
from ...convert.targets import read_target_config
from ...convert.tensor_io import byte_source, f32_to_bf16, patched_writer, tensor_writer, to_f32
from ...convert.textmodel import add_textmodel_keys, rope_parameters
from ...convert.vocab import add_target_vocab
from ...errors import ConfigError, IncompatiblePairError, InputError, TensorError, UnsupportedModelError
from ...ggufio import GGUFPlan, TensorOut
from ...ggufio.layout import GGML_QUANT_VERSION
from ..findings import Interpretation
from .gguf_format import (
    ARCH,
    DFLASH2_TENSOR_MAP,
    DSPARK_MARKER,
    DSPARK_REQUIRED,
    DSPARK_TENSOR_MAP,
    EMBEDDING_TENSORS,
    GEMMA4_DSPARK_RENAMES,
    GEMMA4_DSPARK_TENSOR_MAP,
    TENSOR_MAP,
    DFlash2Shape,
    DSparkShape,
    Keys,
    expected_shapes,
    gguf_taps,
    shape_key,
)
from .rules import MASK_EMBEDDING, DFlashSpec, Gemma4Params

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_INT_DTYPES = {"I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1"}


def _map_tensors(refs: dict[str, TensorRef], cfg: DFlashSpec, notes: list[str],
                 dspark_extra: dict[str, TensorRef] | None = None) -> list[tuple[str, TensorRef]]:
    """HF names -> GGUF names in b11434's order; refuse what its DFlash loader cannot take.

    For a DSpark drafter ``dspark_extra`` receives ``d2t`` and a full-vocabulary ``lm_head`` (the converter
    decides about them once every tensor is known)."""
    src = cfg.path.parent
    gemma = _gemma4(cfg)
    table = {**TENSOR_MAP, **(DFLASH2_TENSOR_MAP if cfg.dflash2 else {}), **(DSPARK_TENSOR_MAP if cfg.dspark else {}),
             **(GEMMA4_DSPARK_TENSOR_MAP if gemma else {})}
    mapped: list[tuple[str, TensorRef]] = []
    unknown: list[str] = []
    for hf_name, ref in refs.items():
        name = hf_name.removeprefix("model.")
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if gemma is not None:  # Gemma4DSparkModel.filter_tensors
            name = next((new + name[len(old):] for old, new in GEMMA4_DSPARK_RENAMES.items()
                         if name.startswith(old)), name)
            if name in table:
                mapped.append((table[name], ref))
                continue
        elif cfg.dspark is not None and dspark_extra is not None:
            if name == "t2d":  # DSparkModel.filter_tensors: not used at runtime
                continue
            if name == "d2t":
                dspark_extra["d2t"] = ref
                continue
            if name == "lm_head.weight" and not cfg.dspark.reduced_vocab:
                dspark_extra["lm_head"] = ref  # kept or dropped by _dspark_heads
                mapped.append(("output.weight", ref))
                continue
            if name in table:
                mapped.append((table[name], ref))
                continue
        if name.endswith(".bias"):
            raise UnsupportedModelError(
                f"{src}: tensor {hf_name!r} is an attention/projection bias. llama.cpp b11434's DFlash loader has "
                "no bias tensors, so the file would fail at load with 'wrong number of tensors'; dropping trained "
                "biases would change the model. This drafter cannot be served by llama.cpp b11434."
            )
        if name in ("d2t", "t2d"):
            raise UnsupportedModelError(
                f"{src}: tensor {hf_name!r} is a reduced draft vocabulary map. llama.cpp b11434 reads d2t only in "
                f"Qwen-style DSpark checkpoints; for this {_kind(cfg)} drafter its converter aborts on it ('Can not "
                "map tensor'). This drafter cannot be served by llama.cpp b11434."
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
        kind = _kind(cfg)
        raise TensorError(
            f"{src}: unsupported drafter tensor(s) {unknown[:6]}{' ...' if len(unknown) > 6 else ''}. llama.cpp "
            f"b11434's DFlash loader creates only the {kind} tensor set for this config, so a file carrying them "
            "fails at load with 'wrong number of tensors'. This drafter variant cannot be served by llama.cpp b11434."
        )
    have = {n for n, _ in mapped}
    required = {v.format(i=i): k.format(i=i) for k, v in table.items()
                for i in (range(cfg.n_layer) if "{i}" in k else [None])
                if (k not in DSPARK_TENSOR_MAP or v in DSPARK_REQUIRED)
                and not (gemma is not None and v == "blk.{i}.attn_v.weight")}  # Gemma-4's k = v attention
    if missing := sorted(f"{required[n]} ({n})" for n in set(required) - have):
        raise TensorError(
            f"{src}: tensor(s) missing from the checkpoint: {missing[:6]}{' ...' if len(missing) > 6 else ''} "
            f"(a {_kind(cfg)} drafter with {cfg.n_layer} layers has {len(required)}). "
            "llama.cpp would fail with 'check_tensor_dims: tensor ... not found'. Re-download the complete checkpoint."
        )
    return mapped


def _kind(cfg: DFlashSpec) -> str:
    if cfg.dspark is not None:
        return "Gemma-4 DSpark" if cfg.dspark.gemma4 is not None else "DSpark"
    return "DFlash2" if cfg.dflash2 else "DFlash1"


def _gemma4(cfg: DFlashSpec) -> Gemma4Params | None:
    """The Gemma-4 part of a Gemma4DSparkModel drafter's spec (None for every other drafter)."""
    return cfg.dspark.gemma4 if cfg.dspark is not None else None


def _same_bytes(a: TensorRef, b: TensorRef) -> bool:
    """Whether two checkpoint tensors hold the same values in the same encoding (read in bounded chunks)."""
    if (a.dtype, a.shape, a.nbytes) != (b.dtype, b.shape, b.nbytes):
        return False
    step = 16 * 1024 * 1024
    with open(a.path, "rb") as fa, open(b.path, "rb") as fb:
        for start in range(0, a.nbytes, step):
            n = min(step, a.nbytes - start)
            fa.seek(a.offset + start)
            fb.seek(b.offset + start)
            if fa.read(n) != fb.read(n):
                return False
    return True


def _d2t_tensor(ref: TensorRef, cfg: DFlashSpec) -> TensorOut:
    """DSparkModel.prepare_tensors: ``d2t`` offsets turned into absolute target ids (``d2t + arange``), written I64,
    after every range and uniqueness check a wrong table would fail at draft time."""
    ds = cfg.dspark
    assert ds is not None, "a d2t table belongs to a DSpark drafter"
    src = cfg.path.parent
    if ref.dtype not in _INT_DTYPES:
        raise TensorError(f"{ref.path}: tensor {ref.name!r} has dtype {ref.dtype}; a d2t table holds integer offsets "
                          "(I64 or I32). Re-download the checkpoint.")
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        raw = np.frombuffer(f.read(ref.nbytes), dtype=_INT_DTYPES[ref.dtype])
    ids = raw.astype(np.int64).reshape(-1) + np.arange(raw.size, dtype=np.int64)
    if ids.size != ds.draft_vocab_size:
        raise TensorError(f"{src}: d2t has {ids.size} entries but draft_vocab_size is {ds.draft_vocab_size} in "
                          f"{cfg.path.name}; llama.cpp b11434's converter stops with 'd2t size ... does not match "
                          "draft_vocab_size'. The config and weights do not belong together: re-download them.")
    if bad := np.flatnonzero((ids < 0) | (ids >= ds.vocab_size))[:5].tolist():
        raise TensorError(f"{src}: d2t maps draft rows {bad} to target ids outside 0..{ds.vocab_size - 1} (d2t + "
                          "row index); llama.cpp b11434's converter stops with 'd2t target ids out of range', and a "
                          "drafted id outside the vocabulary would crash the target's sampler. Re-download the "
                          "checkpoint, or pick the drafter made for this vocabulary.")
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size != ids.size:
        dup = uniq[counts > 1][:5].tolist()
        raise TensorError(f"{src}: d2t maps several draft rows to the same target ids {dup}; llama.cpp b11434's "
                          "converter stops with 'd2t contains duplicate target ids' (the draft vocabulary must be a "
                          "set of distinct target tokens). Re-download the checkpoint.")
    data = ids.astype("<i8").tobytes()
    return TensorOut("d2t", (int(ids.size),), GGMLQuantizationType.I64, lambda out: out.write(data))


def _dspark_heads(cfg: DFlashSpec, mapped: list[tuple[str, TensorRef]], extra: dict[str, TensorRef],
                  notes: list[str]) -> tuple[list[tuple[str, TensorRef]], TensorOut | None]:
    """The output head and d2t of a DSpark drafter (b11434 DSparkModel.modify_tensors / prepare_tensors).

    A full-vocabulary draft's ``lm_head`` is dropped by b11434, and the loader then uses the drafter's own
    ``token_embd`` as the output head (or, without one, the target's). That is right only when the two tables are
    equal, so a head that differs from the drafter's embeddings is kept as ``output.weight`` (the loader takes it)."""
    src = cfg.path.parent
    if (gemma := _gemma4(cfg)) is not None:  # a DFlashModel subclass: its lm_head is written as output
        if not gemma.tied and "output.weight" not in dict(mapped):
            raise TensorError(f"{src}: no lm_head.weight and tie_word_embeddings is not true in {cfg.path.name}; "
                              "llama.cpp b11434's converter stops with \"Gemma4 DSpark requires lm_head.weight "
                              "unless tie_word_embeddings is true\". Re-download the complete checkpoint.")
        return mapped, None
    lm_head = extra.get("lm_head")
    if lm_head is not None:
        embd = dict(mapped).get("token_embd.weight")
        if embd is not None and not _same_bytes(embd, lm_head):
            notes.append(f"{lm_head.name} kept as output.weight: it differs from the drafter's embed_tokens, and "
                         "llama.cpp b11434's converter would drop it (DSparkModel.modify_tensors), leaving the loader "
                         "to use token_embd as the output head, which would change every draft")
        else:
            mapped = [(n, r) for n, r in mapped if r is not lm_head]
            if embd is None:
                notes.append(f"{lm_head.name} dropped as llama.cpp b11434 does for a full-vocabulary DSpark draft: "
                             "the drafter uses the target's output head")
    ds = cfg.dspark
    assert ds is not None, "the Markov heads belong to a DSpark drafter"
    if (d2t := extra.get("d2t")) is None and ds.reduced_vocab:
        raise TensorError(f"{src}: draft_vocab_size {ds.draft_vocab_size} < vocab_size "
                          f"{ds.vocab_size} in {cfg.path.name}, but the checkpoint has no d2t table mapping "
                          "draft rows to target tokens; llama.cpp b11434's converter stops with 'no d2t table found'. "
                          "Re-download the complete checkpoint.")
    return mapped, None if d2t is None else _d2t_tensor(d2t, cfg)


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
    f32 = values.data.astype(np.float32) if values.dtype == "F64" else to_f32(values.data.tobytes(), values.dtype)
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


def _rope_freqs(factors: tuple[float, ...]) -> TensorOut:
    """The proportional rope's ``rope_freqs``: 1 on the rotated pairs, 1e30 (never rotated) on the rest."""
    data = np.asarray(factors, dtype="<f4").tobytes()
    return TensorOut("rope_freqs.weight", (len(factors),), GGMLQuantizationType.F32, lambda out: out.write(data))


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
    if (gemma := _gemma4(cfg)) is not None:  # Gemma-4's global attention: what Gemma4DSparkModel writes
        nkv, hd = gemma.head_count_kv, gemma.head_dim
    v2, ds = cfg.dflash2, cfg.dspark
    w1 = dict(mapped).get(DSPARK_MARKER)
    expect = expected_shapes(hidden=h, heads=nh, kv_heads=nkv, head_dim=hd, ffn=f, n_taps=k, dflash2=None if v2 is None
                             else DFlash2Shape(v2.conv_kernel_size, v2.conv_group_size, v2.selector_rank,
                                               int(hp["vocab_size"])),
                             dspark=None if ds is None or w1 is None or len(w1.shape) != 2
                             else DSparkShape(w1.shape[1], ds.vocab_size, ds.draft_vocab_size))
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


def _add_hparams(plan: GGUFPlan, cfg: DFlashSpec, target: TargetConfig, ftype: LlamaFileType,
                 has_confidence_head: bool = False) -> None:
    """The keys of TextModel.set_gguf_parameters + DFlashModel.set_gguf_parameters, in their order."""
    hp = cfg.hp
    add_textmodel_keys(plan, ARCH, hp, ftype)  # DFlashModel derives from TextModel (via Qwen3Model)
    gemma = _gemma4(cfg)
    rope = rope_parameters(hp) if gemma is None else gemma.rope  # Gemma4DSparkModel: the full-attention rope

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
    if (gemma := _gemma4(cfg)) is not None:  # Gemma4DSparkModel.set_gguf_parameters, after DFlashModel's
        plan.add_uint32(Keys.HEAD_COUNT_KV, gemma.head_count_kv)
        plan.add_uint32(Keys.KEY_LENGTH, gemma.head_dim)
        plan.add_uint32(Keys.VALUE_LENGTH, gemma.head_dim)
        plan.add_uint32(Keys.ROPE_DIMENSION_COUNT, gemma.head_dim)
        plan.add_float32(Keys.EMBEDDING_SCALE, gemma.embedding_scale)
        plan.add_float32(Keys.ATTENTION_SCALE, 1.0)
        plan.add_string(Keys.HIDDEN_ACT, "gelu_pytorch_tanh")
    if cfg.dspark is not None:  # DSparkModel.set_gguf_parameters, after DFlashModel's (and Gemma4DSparkModel's)
        plan.add_bool(Keys.SAMPLE_FROM_ANCHOR, cfg.dspark.sample_from_anchor)
        plan.add_bool(Keys.HAS_CONFIDENCE_HEAD, has_confidence_head)


def convert(
    reading: Interpretation[DFlashSpec],
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
    """Convert a DFlash, DFlash2 or DSpark drafter (already read by its family) for llama.cpp b11434.

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
    cfg = reading.require()
    for finding in reading.findings:
        if finding.note and finding.severity == "warning":
            log.warning("%s: %s", cfg.path, finding.message)
    target = read_target_config(target_dir)
    facts = target.facts()
    target_rules = drafters.target_findings(facts)
    drafters.first_error((*target_rules, *drafters.pair_findings(reading, facts)))
    notes = [*reading.notes, *(f.message for f in target_rules if f.note)]
    extra: dict[str, TensorRef] = {}
    mapped = _map_tensors(index_checkpoint(drafter_dir), cfg, notes, extra)
    d2t: TensorOut | None = None
    if cfg.dspark is not None:
        mapped, d2t = _dspark_heads(cfg, mapped, extra, notes)
    _check_shapes(mapped, cfg)
    patch: MaskRow | None = None
    gemma = _gemma4(cfg)
    if (drafter_dir / MASK_EMBEDDING).is_file():
        if gemma is None:
            mapped, patch = _mask_embedding(drafter_dir, cfg, target_dir, target, mapped)
        else:
            notes.append(f"{MASK_EMBEDDING} ignored, as llama.cpp b11434's Gemma4DSparkModel ignores it (it "
                         "generates no tensors from it)")
    outtype = resolve_outtype(outtype, (ref for _, ref in mapped))
    ftype, qtype = OUTTYPES[outtype]

    plan = GGUFPlan(ARCH)
    add_general(plan, (provenance or {}).get(prov.DRAFTER_REPO) or drafter_dir.name, drafter_dir)
    if gemma is not None and gemma.rope_freqs is not None:  # Gemma4DSparkModel.generate_extra_tensors, first
        plan.add_tensor(_rope_freqs(gemma.rope_freqs))
    for name, ref in mapped:
        tq = tensor_type(name, ref.shape, qtype)
        if patch is not None and name == "token_embd.weight":
            plan.add_tensor(TensorOut(name, tuple(reversed(ref.shape)), tq, patched_writer(ref, tq, patch.row,
                                                                                          patch.raw)))
            continue
        plan.add_tensor(TensorOut(name, tuple(reversed(ref.shape)), tq, tensor_writer(ref, tq),
                                  byte_source(ref, tq)))
    if d2t is not None:
        plan.add_tensor(d2t)  # written last, after every checkpoint tensor (DSparkModel.prepare_tensors)
    _add_hparams(plan, cfg, target, ftype, any(n.startswith("conf_proj.") for n, _ in mapped))
    plan.add_uint32(Keys.QUANTIZATION_VERSION, GGML_QUANT_VERSION)
    vocab = add_target_vocab(plan, tokenizer_dir or target_dir, target, int(cfg.hp["vocab_size"]))
    if cfg.mask_token_id >= vocab.n_tokens:
        raise IncompatiblePairError(
            f"Drafter {cfg.path} has mask_token_id {cfg.mask_token_id}, outside the {vocab.n_tokens}-token vocabulary "
            f"of target {target_dir}. llama.cpp would abort on the first draft. Pick the drafter made for this target."
        )
    plan.add_uint32(Keys.MASK_TOKEN_ID, cfg.mask_token_id)

    recorded = target_record(target_dir, target.path, target.arch, vocab.sha256,
                             {prov.DRAFTER_SOURCE: prov.folder_label(drafter_dir), **drafter_card_record(drafter_dir),
                              **(provenance or {})})
    return finish(plan, Path(outfile), outtype, vocab, tuple(notes), recorded, start, quant=quant, dry_run=dry_run,
                  on_progress=on_progress)


__all__ = ["OUTTYPES", "convert", "target_embedding_fingerprint"]
