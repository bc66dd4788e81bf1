"""Checks of an EAGLE-3 drafter GGUF (general.architecture eagle3) and of its pair with a target GGUF.

Sources: ``llama_model_eagle3::load_arch_hparams`` / ``load_arch_tensors`` (src/models/eagle3.cpp: keys, the
exact tensor set and shapes) and ``common_speculative_impl_draft_eagle3`` (common/speculative.cpp: 3 taps, each
at most the target's layer count, and the target features it copies). llama-server never infers
``--spec-type draft-eagle3`` from the file (``common_speculative_types_from_gguf`` knows only dflash), so the
format report names it.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import GGUFValueType as VT
from gguf import Keys as GKeys

from ...convert.targets import by_gguf
from ...ggufio.layout import type_name
from ...ggufio.reader import GGUFMeta, int_key, read_i64
from ...vocab_hash import VOCAB_HASH_KEYS
from ..findings import Report
from .rules import GGUF_ARCH, N_TAPS, SPEC_TYPE

ARCH = GGUF_ARCH
RECONVERT = "Reconvert the EAGLE-3 head from its Hugging Face checkpoint with dflash-convert --target TARGET."
PICK = "Pair the EAGLE-3 head with the target it was converted for (or reconvert it with --target this target)."
ENC_NORM = "enc.output_norm.weight"
REQUIRED_TENSORS = ("fc.weight", "output_norm.weight", *(f"blk.0.{n}.weight" for n in (
    "attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
    "ffn_down")))
OPTIONAL_TENSORS = ("output.weight", "token_embd.weight", "rope_freqs.weight", "d2t")
# key -> accepted value type, required first (llama_model_loader get_key / get_arr)
REQUIRED_KEYS = {f"{ARCH}.block_count": VT.UINT32, f"{ARCH}.context_length": VT.UINT32,
                 f"{ARCH}.embedding_length": VT.UINT32, f"{ARCH}.attention.layer_norm_rms_epsilon": VT.FLOAT32,
                 f"{ARCH}.target_layers": VT.ARRAY, f"{ARCH}.target_hidden_size": VT.UINT32,
                 GKeys.Tokenizer.MODEL: VT.STRING}
OPTIONAL_KEYS = {f"{ARCH}.norm_before_residual": VT.BOOL, f"{ARCH}.norm_before_fc": VT.BOOL,
                 f"{ARCH}.feed_forward_length": VT.UINT32, f"{ARCH}.attention.head_count": VT.UINT32,
                 f"{ARCH}.attention.head_count_kv": VT.UINT32, f"{ARCH}.attention.key_length": VT.UINT32,
                 f"{ARCH}.rope.dimension_count": VT.UINT32}
SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id", "eot_token_id",
                "add_bos_token")


def eagle3_taps(meta: GGUFMeta) -> list[int] | None:
    kv = meta.kv.get(f"{ARCH}.target_layers")
    if kv is None or kv.vtype != VT.ARRAY or kv.subtype not in (VT.INT32, VT.UINT32, VT.INT64, VT.UINT64):
        return None
    return [int(x) for x in kv.value]


def check_drafter(d: GGUFMeta, t: GGUFMeta | None) -> Report:
    """format.* of the head, then pair.* with the target when one is given."""
    r = check_format(d)
    if t is not None:
        r.extend(check_pair(d, t))
    else:
        r.skip("pair.target", "no target GGUF given: pair checks (vocabulary, target hidden size, taps, d2t) not run",
               "error")
    return r


def check_format(d: GGUFMeta) -> Report:
    """format.*: what the EAGLE-3 loader reads from the file alone, and the spec type to serve it with."""
    r = Report()
    if d.arch != ARCH:
        r.fail("format.arch", "error", f"{d.path.name} has general.architecture {d.arch!r}, not eagle3.", RECONVERT)
        return r
    r.ok("format.arch", f"EAGLE-3 drafter (eagle3): serve it with --spec-type {SPEC_TYPE}; llama-server b11434 does "
         "not infer that spec type from the file")
    bad = [f"{k} {'missing' if k not in d.kv else type_name(d.kv[k].vtype)}" for k, vt in REQUIRED_KEYS.items()
           if k not in d.kv or d.kv[k].vtype != vt]
    bad += [f"{k} {type_name(d.kv[k].vtype)}" for k, vt in OPTIONAL_KEYS.items() if k in d.kv and d.kv[k].vtype != vt]
    if bad:
        r.fail("format.key_types", "error", f"keys missing or of the wrong type: {', '.join(bad)}; llama.cpp b11434's "
               "loader stops with 'key not found' or 'wrong type'.", RECONVERT)
    else:
        r.ok("format.key_types", "every key the EAGLE-3 loader reads has its type")
    taps = eagle3_taps(d)
    if taps is None or len(taps) != N_TAPS or min(taps) < 0:
        r.fail("format.taps", "error", f"eagle3.target_layers is {taps!r}: llama.cpp b11434's loader stops with "
               "\"EAGLE3 requires exactly 3 entries in 'extract_layers'\" (or taps no layer).", RECONVERT)
    else:
        r.ok("format.taps", f"3 target taps {taps}")
    if d.get(f"{ARCH}.block_count") != 1:
        r.fail("format.block_count", "error", f"block_count is {d.get(f'{ARCH}.block_count')!r}; the EAGLE-3 graph has "
               "exactly one decoder layer (GGML_ASSERT(n_layer == 1)).", RECONVERT)
    nbf = d.get(f"{ARCH}.norm_before_fc") is True
    expected = {*REQUIRED_TENSORS, *([ENC_NORM] if nbf else [])}
    have = set(d.tensors)
    missing, extra = sorted(expected - have), sorted(have - expected - set(OPTIONAL_TENSORS))
    if missing or extra:
        why = (f" ({ENC_NORM} exists only when eagle3.norm_before_fc is true)" if ENC_NORM in extra + missing else "")
        r.fail("format.tensors", "error", f"tensor set differs from the EAGLE-3 loader's: missing {missing}, extra "
               f"{extra}{why}; llama.cpp b11434 stops with 'missing tensor' or 'wrong number of tensors'.", RECONVERT)
    else:
        r.ok("format.tensors", f"the EAGLE-3 tensor set (norm_before_fc {str(nbf).lower()}"
             f"{', d2t' if 'd2t' in have else ''}{', own token_embd' if 'token_embd.weight' in have else ''})")
    _check_shapes(d, r, nbf)
    return r


def _check_shapes(d: GGUFMeta, r: Report, nbf: bool) -> None:
    """format.shapes and format.d2t: llama_model_eagle3::load_arch_tensors' create_tensor shapes (ggml ne)."""
    h, ff = int_key(d, f"{ARCH}.embedding_length"), int_key(d, f"{ARCH}.feed_forward_length")
    nh, nkv = int_key(d, f"{ARCH}.attention.head_count"), int_key(d, f"{ARCH}.attention.head_count_kv")
    th = int_key(d, f"{ARCH}.target_hidden_size")
    if h is None or ff is None or nh is None or th is None:
        r.skip("format.shapes", "embedding_length, feed_forward_length, head_count or target_hidden_size missing "
               "(see format.key_types)", "error")
        return
    nkv = nkv or nh
    hd = int_key(d, f"{ARCH}.attention.key_length") or h // nh
    n_vocab = len(d.get(GKeys.Tokenizer.LIST) or [])
    d2t = d.tensors.get("d2t")
    n_draft = int(d2t.ne[0]) if d2t is not None and d2t.ne else n_vocab
    want = {"fc.weight": (3 * th, h), ENC_NORM: (3 * th,), "output_norm.weight": (h,), "output.weight": (h, n_draft),
            "blk.0.attn_norm.weight": (h,), "blk.0.attn_norm_2.weight": (h,), "blk.0.attn_q.weight": (2 * h, hd * nh),
            "blk.0.attn_k.weight": (2 * h, hd * nkv), "blk.0.attn_v.weight": (2 * h, hd * nkv),
            "blk.0.attn_output.weight": (hd * nh, h), "blk.0.ffn_norm.weight": (h,), "blk.0.ffn_gate.weight": (h, ff),
            "blk.0.ffn_up.weight": (h, ff), "blk.0.ffn_down.weight": (ff, h)}
    wrong = [f"{n} {list(t.ne)} (expected {list(want[n])})" for n, t in d.tensors.items()
             if n in want and tuple(t.ne) != want[n]]
    if wrong:
        r.fail("format.shapes", "error", f"shapes differ from what the keys imply (embedding {h}, target hidden {th}, "
               f"heads {nh}/{nkv} of {hd}, ffn {ff}, {n_draft} draft rows): {'; '.join(wrong[:4])}. llama.cpp b11434 "
               "stops with \"tensor '...' has wrong shape\".", RECONVERT)
    else:
        r.ok("format.shapes", f"fc reads 3 x {th} target features into {h}; q/k/v read 2 x {h}")
    if d2t is None:
        r.ok("format.d2t", "no d2t: the draft vocabulary is the target's")
    elif d2t.qtype != GGMLQuantizationType.I64 or len(d2t.ne) != 1:
        r.fail("format.d2t", "error", f"d2t is {d2t.type_name} {list(d2t.ne)}, not a 1-D I64 table of target ids.",
               RECONVERT)
    elif "output.weight" not in d.tensors:
        r.fail("format.d2t", "error", "d2t without output.weight: the loader would fall back to the target's head, "
               "which has one row per target token, not per draft row.", RECONVERT)
    else:
        r.ok("format.d2t", f"d2t maps {n_draft} draft rows to target tokens")


def _first_diff(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"first difference at id {i}: {x!r} vs {y!r}"
    return f"lengths {len(a)} vs {len(b)}"


def check_pair(d: GGUFMeta, t: GGUFMeta) -> Report:
    """pair.*: the vocabulary, target_hidden_size, taps and d2t against the target GGUF."""
    r = Report()
    tarch = t.arch or "?"
    h_t, n_layer = int_key(t, f"{tarch}.embedding_length"), int_key(t, f"{tarch}.block_count")
    th = int_key(d, f"{ARCH}.target_hidden_size")
    if h_t is None or th is None:
        r.skip("pair.hidden", "target embedding_length or drafter target_hidden_size missing", "error")
    elif th != h_t:
        r.fail("pair.hidden", "error", f"the drafter's eagle3.target_hidden_size is {th} but the target's "
               f"{tarch}.embedding_length is {h_t}: llama-server b11434 loads the pair and fails at the first request "
               "(\"get_sub_batch: failed to add embedding\").", PICK)
    else:
        r.ok("pair.hidden", f"target hidden size {h_t} = eagle3.target_hidden_size")
    taps = eagle3_taps(d)
    if taps is None or n_layer is None:
        r.skip("pair.taps", "taps or target block_count missing", "error")
    elif max(taps) > n_layer:
        r.fail("pair.taps", "error", f"taps {taps} go past the target's {n_layer} layers: llama-server b11434 aborts "
               f"at start-up with \"EAGLE3: target layer id {max(taps)} exceeds target n_layer {n_layer}\".", PICK)
    elif max(taps) == n_layer and ((known := by_gguf(tarch)) is None or not known.output_tap):
        r.fail("pair.taps", "error", f"tap {n_layer} is the target's output, which the {tarch} graph does not publish: "
               f"the first request aborts with \"EAGLE3: target layer {n_layer} input not extracted.\"", PICK)
    elif len(set(taps)) != len(taps):
        r.fail("pair.taps", "warning", f"taps {taps} repeat a layer: the head was not trained for this target.", PICK)
    else:
        r.ok("pair.taps", f"taps {taps} within the target's {n_layer} layers")
    diffs = [f"{k} {d.get(k)!r} vs {t.get(k)!r}" for k in (GKeys.Tokenizer.MODEL, GKeys.Tokenizer.PRE)
             if d.get(k) != t.get(k)]
    for key in VOCAB_HASH_KEYS:
        a, b = d.get(key), t.get(key)
        a, b = (a.tolist() if hasattr(a, "tolist") else a), (b.tolist() if hasattr(b, "tolist") else b)
        if a != b:
            diffs.append(f"{key} differs ({_first_diff(a or [], b or [])})")
    diffs += [f"{k} {d.get('tokenizer.ggml.' + k)!r} vs {t.get('tokenizer.ggml.' + k)!r}" for k in SPECIAL_KEYS
              if d.get("tokenizer.ggml." + k) != t.get("tokenizer.ggml." + k)]
    n_vocab = len(t.get(GKeys.Tokenizer.LIST) or [])
    if diffs:
        r.fail("pair.vocab", "error", "drafter and target vocabularies differ: " + "; ".join(diffs[:4]) + ". The "
               "EAGLE-3 head drafts target token ids (directly or through d2t): llama-server refuses or mis-drafts.",
               PICK)
    else:
        r.ok("pair.vocab", f"identical vocabulary ({n_vocab} tokens, types, merges, special tokens)")
    if "d2t" in d.tensors and d.tensors["d2t"].qtype == GGMLQuantizationType.I64:
        ids = read_i64(d, "d2t")
        if ids is None:
            r.fail("pair.d2t", "error", "d2t cannot be read (the file is truncated).", RECONVERT)
        elif ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n_vocab):
            bad = np.flatnonzero((ids < 0) | (ids >= n_vocab))[:5].tolist()
            r.fail("pair.d2t", "error", f"d2t maps draft rows {bad} outside the target's {n_vocab} tokens: a drafted "
                   "id outside the vocabulary crashes the target's sampler.", PICK)
        else:
            r.ok("pair.d2t", f"d2t ids within the target's {n_vocab} tokens")
    return r


__all__ = ["ARCH", "check_format", "check_pair", "eagle3_taps"]
