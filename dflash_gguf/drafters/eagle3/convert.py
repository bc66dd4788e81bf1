"""EAGLE-3 head + target dir -> one GGUF, identical to llama.cpp b11434's ``LlamaModel`` EAGLE-3 output.

What b11434's converter does for an EAGLE-3 head (conversion/llama.py), in its order:

* ``general.architecture`` eagle3, then (from ``LlamaModel.__init__``) ``eagle3.target_layers`` (INT32 array:
  ``eagle_aux_hidden_state_layer_ids`` as written, or ``[2, N//2, N-3]``), ``eagle3.target_hidden_size`` (the
  drafter's, else the target's), ``eagle3.norm_before_residual`` and ``eagle3.norm_before_fc``; then the general
  keys, TextModel's keys, ``eagle3.vocab_size`` and ``eagle3.rope.dimension_count``; then the vocabulary, which
  ``LlamaModel.set_vocab`` reads from the *target* folder.
* tensors in checkpoint order: ``midlayer.*`` / ``layers.0.*`` are layer 0, Q/K rows interleaved per head
  (``LlamaModel.permute``), ``input_norm`` -> ``enc.output_norm``, ``hidden_norm`` -> ``blk.0.attn_norm_2``,
  ``fc`` kept, ``t2d`` dropped, a llama3 ``rope_freqs`` generated first and ``d2t`` written last as I64
  absolute target ids (``d2t + arange``).

Every rule of the loader (src/models/eagle3.cpp) and of ``draft-eagle3`` (common/speculative.cpp) that the file
alone or the pair can break is checked before anything is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from ... import drafters
from ... import provenance as prov
from ...convert.general import add_general
from ...convert.outtype import OUTTYPES, resolve_outtype, tensor_type
from ...convert.result import ConvertResult, drafter_card_record, finish, target_record
from ...convert.safetensors import IGNORED_SUFFIXES, TensorRef, index_checkpoint
from ...convert.targets import read_target_config
from ...convert.targets.base import TensorSpec
from ...convert.targets.llama import llama3_rope_factors, rope_row_order
from ...convert.targets.writers import spec_writer
from ...convert.textmodel import add_textmodel_keys, rope_parameters
from ...convert.vocab import VocabInfo, add_bpe_vocab, add_sentencepiece_vocab
from ...errors import NotCoveredError, TensorError, UnsupportedModelError
from ...ggufio import GGUFPlan, TensorOut
from ...ggufio.layout import GGML_QUANT_VERSION
from ...hf_configs import parse_tokenizer_json
from ...jsonfile import read_json
from ...tensor_names import DECODER_BLOCK
from ..findings import Interpretation
from .rules import GGUF_ARCH, Eagle3Spec, target_taps

log = logging.getLogger(__name__)

ARCH = GGUF_ARCH
KEY_TARGET_LAYERS = f"{ARCH}.target_layers"
KEY_TARGET_HIDDEN_SIZE = f"{ARCH}.target_hidden_size"
KEY_NORM_BEFORE_RESIDUAL = f"{ARCH}.norm_before_residual"
KEY_NORM_BEFORE_FC = f"{ARCH}.norm_before_fc"
ENC_NORM = "enc.output_norm.weight"  # MODEL_TENSOR.ENC_OUTPUT_NORM: the RMSNorm of norm_before_fc
# HF name (after b11434's midlayer.* / layers.0.* -> model.layers.0.* rename) -> GGUF name, for MODEL_ARCH.EAGLE3.
TENSOR_MAP: dict[str, str] = {
    "fc.weight": "fc.weight",
    "input_norm.weight": ENC_NORM,
    "model.layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    **{f"model.layers.0.{hf}.weight": f"blk.0.{gguf}.weight" for hf, gguf in DECODER_BLOCK.items()},
    "norm.weight": "output_norm.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "embed_tokens.weight": "token_embd.weight", "model.embed_tokens.weight": "token_embd.weight",
}
_INT_DTYPES = {"I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1"}
# vocab sizes LlamaModel.set_vocab special-cases (CodeLlama infill tokens, small Granite models)
_SPECIAL_VOCAB_SIZES = {32016: "CodeLlama's infill tokens", 49152: "add_bos_token forced off"}


def _hf_name(name: str) -> str:
    """LlamaModel.index_tensors' EAGLE-3 rename: the one decoder layer becomes ``model.layers.0``."""
    if name.startswith("midlayer."):
        return "model.layers.0." + name[len("midlayer."):]
    if name.startswith("layers.0."):  # speculators' Eagle3Speculator layout
        return "model." + name
    return name


def _map_tensors(refs: dict[str, TensorRef], spec: Eagle3Spec) -> tuple[list[tuple[str, TensorRef]], TensorRef | None]:
    """(GGUF name, tensor) in b11434's order, and the ``d2t`` table; refuse what the EAGLE-3 loader cannot take."""
    src = spec.path.parent
    mapped: list[tuple[str, TensorRef]] = []
    d2t: TensorRef | None = None
    unknown: list[str] = []
    for hf_name, ref in refs.items():
        if hf_name.endswith(IGNORED_SUFFIXES):
            continue
        name = _hf_name(hf_name)
        if name == "t2d":  # LlamaModel.modify_tensors: not used at runtime
            continue
        if name == "d2t":
            d2t = ref
            continue
        if name.endswith(".bias"):
            raise UnsupportedModelError(
                f"{src}: tensor {hf_name!r} is a bias. llama.cpp b11434's EAGLE-3 loader has no bias tensors, so the "
                "file would fail at load with 'wrong number of tensors'; dropping trained biases would change the "
                "model. This EAGLE-3 head cannot be served by llama.cpp b11434.")
        if name not in TENSOR_MAP:
            unknown.append(hf_name)
            continue
        mapped.append((TENSOR_MAP[name], ref))
    if unknown:
        raise TensorError(
            f"{src}: tensor(s) {unknown[:6]}{' ...' if len(unknown) > 6 else ''} are not part of an EAGLE-3 head. "
            "llama.cpp b11434's converter stops on them (\"Can not map tensor\"). Check that --drafter is the EAGLE-3 "
            "checkpoint itself (one decoder layer, fc, norm, lm_head, d2t/t2d).")
    have = dict(mapped)
    if ENC_NORM in have and not spec.norm_before_fc:
        raise TensorError(
            f"{src}: the checkpoint has input_norm.weight but {spec.path.name} does not set norm_before_fc. llama.cpp "
            "b11434 writes it as enc.output_norm.weight, but its loader creates that tensor only when norm_before_fc "
            "is true, so the file fails at load with 'wrong number of tensors'. Set \"norm_before_fc\": true in the "
            "drafter's config.json if the head was trained with that norm (EAGLE-3.1 heads are).")
    required = {v for k, v in TENSOR_MAP.items() if v not in ("output.weight", "token_embd.weight", ENC_NORM)}
    if spec.norm_before_fc:
        required.add(ENC_NORM)
    if spec.reduced_vocab or d2t is not None:
        required.add("output.weight")  # the draft rows' head: the target's has one row per target token
    if missing := sorted(required - set(have)):
        raise TensorError(
            f"{src}: tensor(s) {missing} missing from the checkpoint (norm_before_fc "
            f"{str(spec.norm_before_fc).lower()}, draft_vocab_size {spec.draft_vocab_size}). llama.cpp b11434's "
            "loader would stop with 'missing tensor'. Re-download the complete checkpoint.")
    if spec.reduced_vocab and d2t is None:
        raise TensorError(
            f"{src}: draft_vocab_size {spec.draft_vocab_size} < vocab_size {spec.vocab_size} in {spec.path.name} but "
            "the checkpoint has no d2t table mapping draft rows to target tokens. Without it llama.cpp b11434's loader "
            "expects one lm_head row per target token ('output.weight has wrong shape'). Re-download the checkpoint.")
    return mapped, d2t


def _check_shapes(mapped: list[tuple[str, TensorRef]], spec: Eagle3Spec, th: int, n_draft_vocab: int,
                  n_vocab: int) -> None:
    """llama_model_eagle3::load_arch_tensors' shapes (PyTorch order here), before anything is written."""
    h, f, q, kv = spec.hidden_size, spec.intermediate_size, spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    want = {"fc.weight": (h, 3 * th), ENC_NORM: (3 * th,), "output_norm.weight": (h,),
            "output.weight": (n_draft_vocab, h), "token_embd.weight": (n_vocab, h), "blk.0.attn_norm.weight": (h,),
            "blk.0.attn_norm_2.weight": (h,),
            "blk.0.attn_q.weight": (q, 2 * h), "blk.0.attn_k.weight": (kv, 2 * h), "blk.0.attn_v.weight": (kv, 2 * h),
            "blk.0.attn_output.weight": (h, q), "blk.0.ffn_norm.weight": (h,), "blk.0.ffn_gate.weight": (f, h),
            "blk.0.ffn_up.weight": (f, h), "blk.0.ffn_down.weight": (h, f)}
    for name, ref in mapped:
        if ref.dtype not in ("BF16", "F16", "F32"):
            raise TensorError(f"{ref.path}: tensor {ref.name!r} has dtype {ref.dtype}; EAGLE-3 heads are BF16/F16/F32 "
                              "checkpoints. Quantized or FP8 heads are not supported.")
        if ref.shape != want[name]:
            why = {"fc.weight": f"3 taps x target_hidden_size {th}",
                   ENC_NORM: f"3 taps x target_hidden_size {th}",
                   "output.weight": f"{n_draft_vocab} draft rows", "token_embd.weight": f"{n_vocab} target tokens"}
            raise TensorError(
                f"{ref.path}: tensor {ref.name!r} has shape {list(ref.shape)}, but {why.get(name, 'config.json')} "
                f"(hidden_size {h}, heads {spec.n_head}/{spec.n_head_kv}, head_dim {spec.head_dim}, "
                f"intermediate_size {f}) implies {list(want[name])}; llama.cpp b11434's loader would stop with "
                f"\"tensor '{name}' has wrong shape\". The config and weights do not belong together: re-download "
                "the checkpoint, or pick the head made for this target.")


def _read_d2t(ref: TensorRef, spec: Eagle3Spec, n_target_vocab: int) -> np.ndarray:
    """LlamaModel.prepare_tensors: ``d2t`` offsets as absolute target ids, after its range and uniqueness checks."""
    src = spec.path.parent
    if ref.dtype not in _INT_DTYPES:
        raise TensorError(f"{ref.path}: tensor 'd2t' has dtype {ref.dtype}; a d2t table holds integer offsets (I64 "
                          "or I32). Re-download the checkpoint.")
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        raw = np.frombuffer(f.read(ref.nbytes), dtype=_INT_DTYPES[ref.dtype])
    ids = raw.astype(np.int64).reshape(-1) + np.arange(raw.size, dtype=np.int64)
    if bad := np.flatnonzero((ids < 0) | (ids >= n_target_vocab))[:5].tolist():
        raise TensorError(f"{src}: d2t maps draft rows {bad} to target ids outside 0..{n_target_vocab - 1} (d2t + row "
                          "index); llama.cpp b11434's converter stops with \"EAGLE-3 d2t target ids out of range\". "
                          "Pick the head made for this target's vocabulary, or re-download the checkpoint.")
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size != ids.size:
        raise TensorError(f"{src}: d2t maps several draft rows to the same target ids {uniq[counts > 1][:5].tolist()}; "
                          "llama.cpp b11434's converter stops with \"EAGLE-3 d2t contains duplicate target ids\". "
                          "Re-download the checkpoint.")
    return ids


def add_llama_vocab(plan: GGUFPlan, tok_dir: Path, vocab_size: int) -> VocabInfo:
    """``LlamaModel.set_vocab`` run on the target folder (with the drafter's vocab_size), whatever the target's
    architecture: SentencePiece when there is a tokenizer.model, else GPT-2 BPE; the paths it would take through
    transformers (LlamaHfVocab, Mistral, HybridDNA, CodeLlama/Granite specials) are refused.

    Raises:
        NotCoveredError: a path b11434 takes that is not mirrored here.
        TokenizerError: tokenizer files missing, corrupt, or not matching the drafter.
    """
    def not_covered(why: str) -> NotCoveredError:
        return NotCoveredError(f"{tok_dir}: {why}; llama.cpp b11434's LlamaModel.set_vocab reads it through a path "
                               "dflash-gguf does not mirror. Convert the EAGLE-3 head with llama.cpp's own converter "
                               "(convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET; the pipeline's --llama-cpp "
                               "DIR).")

    if (why := _SPECIAL_VOCAB_SIZES.get(vocab_size)) is not None:
        raise not_covered(f"vocab_size {vocab_size} is a vocabulary LlamaModel.set_vocab treats specially ({why})")
    if (tok_dir / "tekken.json").is_file() and not (tok_dir / "tokenizer.json").is_file():
        raise not_covered("a Mistral tekken.json tokenizer")
    cfg = tok_dir / "tokenizer_config.json"
    if cfg.is_file():
        tc = read_json(cfg)
        if (prefix := tc.get("add_prefix_space")) is not None:
            plan.add_bool("tokenizer.ggml.add_space_prefix", bool(prefix))
        if tc.get("tokenizer_class") == "HybridDNATokenizer":
            raise not_covered("a HybridDNATokenizer")
    if (tok_dir / "tokenizer.model").is_file():
        return add_sentencepiece_vocab(plan, tok_dir, vocab_size)
    if (tok_dir / "tokenizer.json").is_file():
        tj = parse_tokenizer_json(tok_dir / "tokenizer.json", missing="")
        model = tj.get("model") or {}
        is_llama3 = model.get("type") == "BPE" and model.get("ignore_merges", False) \
            and not model.get("byte_fallback", True)
        if not is_llama3 and model.get("type") == "BPE" and model.get("byte_fallback", False) \
                and (tj.get("decoder") or {}).get("type") == "Sequence":
            raise not_covered("a SentencePiece-style BPE tokenizer.json (byte fallback) without tokenizer.model")
    return add_bpe_vocab(plan, tok_dir, vocab_size)


def _add_hparams(plan: GGUFPlan, spec: Eagle3Spec, ftype: LlamaFileType) -> None:
    """LlamaModel.set_gguf_parameters: TextModel's keys, then vocab size and rope dimensions."""
    add_textmodel_keys(plan, ARCH, spec.hp, ftype)
    plan.add_uint32(f"{ARCH}.vocab_size", spec.vocab_size)
    plan.add_uint32(f"{ARCH}.rope.dimension_count", spec.head_dim)


def _rope_freqs(spec: Eagle3Spec) -> TensorOut | None:
    """LlamaModel.generate_extra_tensors: per-frequency factors of a ``rope_type: llama3`` drafter config."""
    rope = rope_parameters(spec.hp)
    rope = rope.get("full_attention", rope)
    if not rope or str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    factors = llama3_rope_factors(float(rope.get("rope_theta", 10000.0)), spec.head_dim, float(rope.get("factor", 8.0)),
                                  float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0)),
                                  int(rope.get("original_max_position_embeddings", 8192)))
    data = np.asarray(factors, dtype="<f4").tobytes()
    return TensorOut("rope_freqs.weight", (len(factors),), GGMLQuantizationType.F32, lambda out: out.write(data))


def convert(
    reading: Interpretation[Eagle3Spec],
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
    """Convert an EAGLE-3 head (already read by its family) for llama.cpp b11434; as ``convert_drafter``.

    Raises:
        ConfigError, UnsupportedModelError, TensorError, IncompatiblePairError, TokenizerError,
        InputError, OutputError: each with a message naming the file, the field and the fix.
    """
    start = time.perf_counter()
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    spec: Eagle3Spec = reading.require()
    target = read_target_config(target_dir)
    facts = target.facts()
    # the target rules that block (arch tappable, a vocabulary we mirror); their notes are about DFlash's path
    drafters.first_error((*drafters.target_findings(facts), *drafters.pair_findings(reading, facts)))
    if facts.vocab_size is None:
        raise TensorError(f"{target.path}: no vocab_size (also under text_config); llama.cpp b11434's EAGLE-3 "
                          "conversion reads it to check d2t. Use the config.json published with the target model.")
    taps = target_taps(spec, target.n_layer)
    th = spec.target_hidden_size or target.hidden_size
    mapped, d2t_ref = _map_tensors(index_checkpoint(drafter_dir), spec)
    ids = _read_d2t(d2t_ref, spec, facts.vocab_size) if d2t_ref is not None else None
    n_draft_vocab = int(ids.size) if ids is not None else spec.vocab_size
    _check_shapes(mapped, spec, th, n_draft_vocab, spec.vocab_size)
    outtype = resolve_outtype(outtype, (ref for _, ref in mapped))
    ftype, qtype = OUTTYPES[outtype]

    plan = GGUFPlan(ARCH)
    plan.add_array(KEY_TARGET_LAYERS, list(taps))  # LlamaModel.__init__, before ModelBase writes anything else
    plan.add_uint32(KEY_TARGET_HIDDEN_SIZE, th)
    plan.add_bool(KEY_NORM_BEFORE_RESIDUAL, spec.norm_before_residual)
    plan.add_bool(KEY_NORM_BEFORE_FC, spec.norm_before_fc)
    add_general(plan, (provenance or {}).get(prov.DRAFTER_REPO) or drafter_dir.name, drafter_dir)
    if (freqs := _rope_freqs(spec)) is not None:
        plan.add_tensor(freqs)
    for name, ref in mapped:
        tq = tensor_type(name, ref.shape, qtype)
        order = None
        if name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):  # LlamaModel.permute (k: the KV head count)
            order = rope_row_order(ref.shape[0], spec.n_head if name == "blk.0.attn_q.weight" else spec.n_head_kv)
        write, source = spec_writer(TensorSpec(name, ref.shape, ref=ref, row_order=order), tq)
        plan.add_tensor(TensorOut(name, tuple(reversed(ref.shape)), tq, write, source))
    if ids is not None:
        data = ids.astype("<i8").tobytes()
        plan.add_tensor(TensorOut("d2t", (int(ids.size),), GGMLQuantizationType.I64, lambda out: out.write(data)))
    _add_hparams(plan, spec, ftype)
    plan.add_uint32("general.quantization_version", GGML_QUANT_VERSION)
    vocab = add_llama_vocab(plan, tokenizer_dir or target_dir, spec.vocab_size)
    notes = reading.notes
    recorded = target_record(target_dir, target.path, target.arch, vocab.sha256,
                             {prov.DRAFTER_SOURCE: prov.folder_label(drafter_dir), **drafter_card_record(drafter_dir),
                              **(provenance or {})})
    return finish(plan, Path(outfile), outtype, vocab, tuple(notes), recorded, start, quant=quant, dry_run=dry_run,
                  on_progress=on_progress)


__all__ = ["ARCH", "TENSOR_MAP", "add_llama_vocab", "convert"]
