"""verify's checks of a dflash GGUF (DFlash, DFlash2 and DSpark files): the format b11434's loader requires
(``src/models/dflash.cpp``, ``src/llama-model.cpp``), and the pair with a target GGUF.

Why each pair check: llama-server b11434 compares none of this before serving; mismatches end as aborts (hidden
size, taps, vocabulary, mask id) or as silent acceptance loss (embedding scale, M-RoPE).
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType
from gguf import GGUFValueType as VT
from gguf import Keys as GKeys

from ... import provenance as prov
from ...ggufio.layout import type_name
from ...ggufio.reader import GGUFMeta, int_key, read_i64
from ...vocab_hash import VOCAB_HASH_KEYS
from .. import check_target_arch
from ..dspark import FAMILY as DSPARK
from ..findings import PICK, Report
from . import FAMILY as DFLASH
from .gguf_format import (
    ARCH,
    BLOCK_TENSORS,
    DFLASH2_TENSOR_MAP,
    DSPARK_MARKER,
    DSPARK_OPTIONAL,
    DSPARK_REQUIRED,
    OPTIONAL_BLOCK_TENSORS,
    OPTIONAL_TENSORS,
    DFlash2Shape,
    DSparkShape,
    Keys,
    expected_shapes,
    gguf_taps_outside,
    shape_key,
)

SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id", "eot_token_id")
RECONVERT = "Reconvert the drafter from its Hugging Face checkpoint with dflash-convert (llama.cpp b11434 layout)."
# DFlash2's keys (src/models/dflash.cpp reads them when the file has selector_hidden.weight)
DFLASH2_KEYS = (Keys.CONV_KERNEL_SIZE, Keys.CONV_GROUP_SIZE, Keys.SELECTOR_RANK, Keys.SELECTOR_TOP_K)
DFLASH2_MARKER = "selector_hidden.weight"

# key -> accepted (type, array element type or None); required keys first. llama-model-loader.cpp get_key.
REQUIRED_KEYS: dict[str, tuple[tuple[int, int | None], ...]] = {
    Keys.BLOCK_COUNT: ((VT.UINT32, None),),
    Keys.CONTEXT_LENGTH: ((VT.UINT32, None),),
    Keys.EMBEDDING_LENGTH: ((VT.UINT32, None),),
    Keys.RMS_EPS: ((VT.FLOAT32, None),),
    Keys.TARGET_LAYERS: ((VT.ARRAY, VT.INT32), (VT.ARRAY, VT.UINT32)),
    GKeys.Tokenizer.MODEL: ((VT.STRING, None),),
}
OPTIONAL_KEYS: dict[str, tuple[tuple[int, int | None], ...]] = {
    Keys.FEED_FORWARD_LENGTH: ((VT.UINT32, None),),
    Keys.HEAD_COUNT: ((VT.UINT32, None),),
    Keys.HEAD_COUNT_KV: ((VT.UINT32, None),),
    Keys.KEY_LENGTH: ((VT.UINT32, None),),
    Keys.VALUE_LENGTH: ((VT.UINT32, None),),
    Keys.SLIDING_WINDOW: ((VT.UINT32, None),),
    Keys.SLIDING_WINDOW_PATTERN: ((VT.ARRAY, VT.BOOL),),
    Keys.CAUSAL: ((VT.BOOL, None),),
    Keys.BLOCK_SIZE: ((VT.UINT32, None),),
    Keys.EMBEDDING_SCALE: ((VT.FLOAT32, None),),
    Keys.LOGIT_SCALE: ((VT.FLOAT32, None),),
    Keys.ROPE_FREQ_BASE: ((VT.FLOAT32, None),),
    Keys.ROPE_DIMENSION_COUNT: ((VT.UINT32, None),),
    Keys.MASK_TOKEN_ID: ((VT.UINT32, None),),
    **{k: ((VT.UINT32, None),) for k in DFLASH2_KEYS},
    Keys.SAMPLE_FROM_ANCHOR: ((VT.BOOL, None),),
    Keys.HAS_CONFIDENCE_HEAD: ((VT.BOOL, None),),
}


def taps(meta: GGUFMeta) -> list[int] | None:
    kv = meta.kv.get(Keys.TARGET_LAYERS)
    if kv is None or kv.vtype != VT.ARRAY or kv.subtype not in (VT.INT32, VT.UINT32, VT.INT64, VT.UINT64):
        return None
    return [int(x) for x in kv.value]


def check_drafter(d: GGUFMeta, t: GGUFMeta | None) -> Report:
    """format.* of the file, then pair.* with the target when the file is a mainline drafter and a target is given."""
    r = check_format(d)
    arch = r.result("format.arch")
    if arch is None or arch.status != "pass":
        return r
    if t is not None:
        r.extend(check_pair(d, t))
    else:
        r.skip("pair.target", "no target GGUF given: pair checks (hidden size, taps, vocabulary, mask id, embedding "
               "scale) not run", "error")
    return r


def check_format(d: GGUFMeta) -> Report:
    """All format.* checks of a drafter; stops after format.arch when the file is no mainline drafter."""
    r = Report()
    arch = d.arch
    if arch == "dflash-draft" or any(k.startswith("dflash-draft.") for k in d.kv):
        r.fail("format.arch", "error", f"{d.path.name} uses the ik_llama.cpp/fork format 'dflash-draft'; llama.cpp "
               "b11434 stops with \"unknown model architecture: 'dflash-draft'\".", RECONVERT)
        return r
    if arch != ARCH:
        found = f"architecture {arch!r}" if arch else "no general.architecture"
        r.fail("format.arch", "error", f"{d.path.name} has {found}, not a DFlash drafter ('dflash').",
               "Pass the drafter GGUF first and the target second; or reconvert the drafter with dflash-convert.")
        return r
    r.ok("format.arch", "architecture 'dflash' (llama.cpp mainline; needs a build with DFlash, b11434 tested)")

    premerge = [x for x in ("hidden_norm.weight",) if x in d.tensors] + \
        [k for k in (f"{ARCH}.mask_token_id", f"{ARCH}.target_hidden_size") if k in d.kv]
    if premerge:
        r.fail("format.layout", "error", f"{d.path.name} has the pre-merge layout ({', '.join(premerge)}): b11434 "
               "stops with \"missing tensor 'enc.output_norm.weight'\", and its taps lack the +1 of the merged "
               "format, so renaming would tap every layer one too early.", RECONVERT + " Do not rename tensors.")
    else:
        r.ok("format.layout", "b11434 layout (enc.output_norm.weight, tokenizer.ggml.mask_token_id, taps +1)")

    missing = [k for k in REQUIRED_KEYS if k not in d.kv]
    if missing:
        r.fail("format.keys", "error", f"missing keys llama.cpp b11434 requires: {', '.join(missing)} (load fails "
               "with 'key not found' or \"DFlash model requires 'target_layers'\").", RECONVERT)
    else:
        r.ok("format.keys", "every key the b11434 loader requires is present")
    wrong = []
    for key, allowed in {**REQUIRED_KEYS, **OPTIONAL_KEYS}.items():
        kv = d.kv.get(key)
        if kv is not None and (kv.vtype, kv.subtype) not in allowed:
            wrong.append(f"{key} is {kv.type_name}, expected {' or '.join(type_name(*a) for a in allowed)}")
    if wrong:
        r.fail("format.key_types", "error", "; ".join(wrong) + " (b11434: 'key ... has wrong type').", RECONVERT)
    else:
        r.ok("format.key_types", "every DFlash key has the GGUF type the loader expects")

    if Keys.MASK_TOKEN_ID in d.kv:
        r.ok("format.mask_token", f"mask token id {d.get('tokenizer.ggml.mask_token_id')}")
    else:
        r.fail("format.mask_token", "error", "no tokenizer.ggml.mask_token_id: llama-server logs mask_token_id=-1 and "
               "aborts on the first draft ('get_sub_batch: failed to add embedding').",
               "Reconvert with a drafter config that has dflash_config.mask_token_id.")

    n_layer = int_key(d, Keys.BLOCK_COUNT)
    window = int_key(d, Keys.SLIDING_WINDOW) or 0
    pattern = d.get(Keys.SLIDING_WINDOW_PATTERN)
    if window > 0 and pattern is None:
        r.fail("format.sliding_window", "error", f"sliding_window {window} without sliding_window_pattern: b11434 "
               "fails with 'array key not found in model: dflash.attention.sliding_window_pattern'.", RECONVERT)
    elif pattern is not None and n_layer is not None and len(pattern) != n_layer:
        r.fail("format.sliding_window", "error", f"sliding_window_pattern has {len(pattern)} entries for {n_layer} "
               "layers.", RECONVERT)
    else:
        r.ok("format.sliding_window", f"sliding window {window or 'off'}")

    if DFLASH2_MARKER in d.tensors:
        _check_dflash2(d, r)
    if DSPARK_MARKER in d.tensors:
        _check_dspark_format(d, r)
    _check_tensors(d, r, n_layer)
    return r


def _check_dspark_format(d: GGUFMeta, r: Report) -> None:
    """format.dspark: the heads and keys draft-dspark reads, and how the file must be served."""
    served = DSPARK.served_as(d.path, d, "")
    limit, has_conf = served.max_n_max, not served.required_p_min == 0.0
    conf_tensor = "conf_proj.weight" in d.tensors
    problems = []
    if has_conf and not conf_tensor:
        problems.append("dflash.has_confidence_head is true (or absent) but the file has no conf_proj.weight: "
                        "draft-dspark would truncate drafts on a confidence it cannot compute")
    if conf_tensor and d.get(Keys.HAS_CONFIDENCE_HEAD) is False:
        problems.append("the file has conf_proj.weight but dflash.has_confidence_head is false")
    d2t = d.tensors.get("d2t")
    if d2t is not None:
        n_vocab = len(d.get(GKeys.Tokenizer.LIST) or [])
        if d2t.qtype != GGMLQuantizationType.I64 or len(d2t.ne) != 1:
            problems.append(f"d2t is {d2t.type_name} {list(d2t.ne)}, not a 1-D I64 table of absolute target ids")
        elif (ids := read_i64(d, "d2t")) is not None and n_vocab:
            if ((ids < 0) | (ids >= n_vocab)).any():
                problems.append(f"d2t holds target ids outside the {n_vocab}-token vocabulary (llama-server would "
                                "index past the target's logits)")
            elif np.unique(ids).size != ids.size:
                problems.append("d2t maps several draft rows to the same target id")
    if problems:
        r.fail("format.dspark", "error", "; ".join(problems) + ".", RECONVERT)
        return
    flags = f"--spec-type draft-dspark --spec-draft-n-max N (N <= {limit})"
    if not has_conf:
        flags += " --spec-draft-p-min 0 (no confidence head: any other p-min makes llama-server stop with 'DSpark " \
                 "draft has no confidence head')"
    vocab = f"reduced draft vocabulary of {d2t.ne[0]} rows (d2t)" if d2t is not None else "full vocabulary"
    r.ok("format.dspark", f"DSpark: Markov head rank {d.tensors[DSPARK_MARKER].ne[0]}, {vocab}, confidence head "
         f"{'yes' if has_conf else 'no'}; serve with {flags}")


def _check_dflash2(d: GGUFMeta, r: Report) -> None:
    """format.dflash2: the conv/selector keys the loader needs once the file has a candidate selector."""
    values = {k: int_key(d, k) for k in (*DFLASH2_KEYS, Keys.BLOCK_SIZE)}
    h = int_key(d, Keys.EMBEDDING_LENGTH) or 0
    group, top_k = values[Keys.CONV_GROUP_SIZE] or 0, values[Keys.SELECTOR_TOP_K] or 0
    if any(v is None or v <= 0 for v in values.values()):
        bad = ", ".join(f"{k.split('.', 1)[1]}={v}" for k, v in values.items())
        r.fail("format.dflash2", "error", f"a DFlash2 file (it has {DFLASH2_MARKER}) needs positive conv/selector "
               f"keys and block size ({bad}): b11434 stops with 'DFlash2 model is missing conv/selector metadata'. "
               "Files written before b11434's converter wrote these keys are such files.", RECONVERT)
    elif h % group:
        r.fail("format.dflash2", "error", f"hidden size {h} is not divisible by conv_group_size {group}: b11434 "
               "stops with 'DFlash2 hidden size must be divisible by conv_group_size'.", RECONVERT)
    elif h < top_k * (top_k + 1):
        r.fail("format.dflash2", "error", f"hidden size {h} < selector_top_k x (selector_top_k + 1) = "
               f"{top_k * (top_k + 1)}: b11434 stops with 'DFlash2 hidden size is too small for the selector "
               "lattice'.", RECONVERT)
    else:
        r.ok("format.dflash2", f"DFlash2: conv kernel {values[Keys.CONV_KERNEL_SIZE]}, group {group}, selector rank "
             f"{values[Keys.SELECTOR_RANK]}, top-k {top_k} (served as --spec-type draft-dflash)")


def _dflash2_shape(d: GGUFMeta) -> DFlash2Shape | None:
    if DFLASH2_MARKER not in d.tensors:
        return None
    kernel, group, rank = (int_key(d, k) for k in DFLASH2_KEYS[:3])
    if not (kernel and group and rank):
        return None  # format.dflash2 reports it
    tokens = d.get("tokenizer.ggml.tokens")
    return DFlash2Shape(kernel, group, rank, len(tokens) if tokens is not None else None)


def _dspark_shape(d: GGUFMeta) -> DSparkShape | None:
    w1 = d.tensors.get(DSPARK_MARKER)
    if w1 is None or len(w1.ne) != 2:
        return None
    tokens = d.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if tokens is not None else None
    d2t = d.tensors.get("d2t")
    return DSparkShape(w1.ne[0], n_vocab, d2t.ne[0] if d2t is not None else n_vocab)


def _check_tensors(d: GGUFMeta, r: Report, n_layer: int | None) -> None:
    names = set(d.tensors)
    # conf_proj.bias is DSpark's confidence head (an optional tensor of its loader), not a layer bias
    biases = sorted(n for n in names if n.endswith(".bias") and not (n == "conf_proj.bias" and DSPARK_MARKER in names))
    if biases:
        r.fail("format.bias", "error", f"{len(biases)} bias tensors ({', '.join(biases[:3])}...): b11434's DFlash "
               "loader creates none and stops with 'wrong number of tensors'.",
               "This drafter (attention_bias: true) cannot be served by llama.cpp b11434; dropping trained biases "
               "would change the model.")
    else:
        r.ok("format.bias", "no bias tensors")
    if n_layer is None:
        r.skip("format.tensors", "no usable dflash.block_count; tensor set not checked", "error")
        r.skip("format.shapes", "no usable dflash.block_count; shapes not checked", "error")
        return
    required = {"fc.weight", "enc.output_norm.weight", "output_norm.weight"}
    optional = set(OPTIONAL_TENSORS)
    for i in range(n_layer):
        required |= {f"blk.{i}.{t}.weight" for t in BLOCK_TENSORS if t != "attn_v"}
        optional |= {f"blk.{i}.attn_v.weight"} | {f"blk.{i}.{t}.weight" for t in OPTIONAL_BLOCK_TENSORS}
    kind, n_expected = "DFlash1", 11 * n_layer + 3
    if DFLASH2_MARKER in names:
        extra2 = {v.format(i=i) for v in DFLASH2_TENSOR_MAP.values()
                  for i in (range(n_layer) if "{i}" in v else [None])}
        required |= extra2
        kind, n_expected = "DFlash2", n_expected + len(extra2)
    if DSPARK_MARKER in names:
        required |= set(DSPARK_REQUIRED)
        optional |= set(DSPARK_OPTIONAL)
        kind, n_expected = "DSpark", n_expected + len(DSPARK_REQUIRED)
    missing = sorted(required - names)
    extra = sorted(names - required - optional - set(biases))
    if missing or extra:
        parts = ([f"missing {', '.join(missing[:5])}" + ("..." if len(missing) > 5 else "")] if missing else []) + \
            ([f"unknown to the b11434 loader: {', '.join(extra[:5])}" + ("..." if len(extra) > 5 else "")]
             if extra else [])
        r.fail("format.tensors", "error", f"{len(names)} tensors for {n_layer} layers ({kind} has "
               f"{n_expected}): {'; '.join(parts)}. b11434 stops with 'missing tensor' or "
               "'wrong number of tensors'.", RECONVERT)
    else:
        r.ok("format.tensors", f"{len(names)} tensors, the {kind} set for {n_layer} layers ({n_expected} required, "
             f"{len(names) - n_expected} optional)")
    _check_shapes(d, r, n_layer)


def _check_shapes(d: GGUFMeta, r: Report, n_layer: int) -> None:
    h = int_key(d, Keys.EMBEDDING_LENGTH)
    nh = int_key(d, Keys.HEAD_COUNT)
    nkv = int_key(d, Keys.HEAD_COUNT_KV) or nh
    hd = int_key(d, Keys.KEY_LENGTH) or (h // nh if h and nh else None)
    ff = int_key(d, Keys.FEED_FORWARD_LENGTH)
    k = len(taps(d) or [])
    per_name = expected_shapes(hidden=h, heads=nh, kv_heads=nkv, head_dim=hd, ffn=ff, n_taps=k,
                               dflash2=_dflash2_shape(d), dspark=_dspark_shape(d))
    want = {name: per_name[shape_key(name)] for name in d.tensors if shape_key(name) in per_name}
    bad = []
    for name, shape in want.items():
        t = d.tensors.get(name)
        if t is None:
            continue
        # check_tensor_dims compares all four ggml dims, a missing one being 1: llama-quantize writes a
        # [96, 1] tensor as [96] (up to ggml_n_dims), and the loader takes it
        got_ne, want_ne = _dims4(t.ne), _dims4(shape)
        if any(w is not None and w != got for w, got in zip(want_ne, got_ne, strict=True)):
            exp = ", ".join("?" if w is None else str(w) for w in shape)
            bad.append(f"{name} is [{', '.join(map(str, t.ne))}], expected [{exp}]")
    if bad:
        r.fail("format.shapes", "error", f"{len(bad)} tensor shapes do not follow from the hyperparameters: "
               f"{'; '.join(bad[:3])} (b11434: 'check_tensor_dims: ... has wrong shape').", RECONVERT)
    else:
        r.ok("format.shapes", f"shapes follow from H={h}, heads={nh}/{nkv}x{hd}, ffn={ff}, taps={k}")


def _dims4(ne: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """``ne`` padded to ggml's four dimensions with 1 (GGUF stores only the first ``ggml_n_dims``)."""
    return (*ne, *(1,) * (4 - len(ne)))


def check_pair(d: GGUFMeta, t: GGUFMeta) -> Report:
    """Structural agreement of drafter ``d`` with target ``t``."""
    r = Report()
    tarch = t.arch or "?"
    check_target_arch(r, tarch)

    h_d, h_t = int_key(d, Keys.EMBEDDING_LENGTH), int_key(t, Keys.of(tarch, Keys.EMBEDDING_LENGTH))
    n_t = int_key(t, Keys.of(tarch, Keys.BLOCK_COUNT))
    if h_d is None or h_t is None:
        r.skip("pair.hidden_size", "hidden size missing on one side", "error")
    elif h_d != h_t:
        r.fail("pair.hidden_size", "error", f"drafter hidden size {h_d} != target embedding_length {h_t}: "
               "llama-server aborts with 'GGML_ASSERT(ggml_can_repeat(b, a))'.", PICK)
    else:
        r.ok("pair.hidden_size", f"hidden size {h_d} on both sides")

    tp = taps(d)
    if not tp or n_t is None:
        r.skip("pair.taps", "taps or target block_count missing", "error")
    else:
        bad = gguf_taps_outside(tp, n_t)
        if bad:
            r.fail("pair.taps", "error", f"drafter taps {tp} (GGUF, HF id + 1) include {bad}, outside 1..{n_t - 1} "
                   f"for a {n_t}-layer target: llama-server aborts ('lid <= n_layer' or 'layer input tensor is "
                   "null').", PICK + " The drafter was trained for a deeper target.")
        else:
            r.ok("pair.taps", f"taps {tp} name layer inputs of the {n_t}-layer target")

    fc = d.tensors.get("fc.weight")
    if fc is None or not tp or h_t is None:
        r.skip("pair.fc_width", "fc.weight, taps or target hidden size missing", "error")
    elif fc.ne[0] != len(tp) * h_t:
        r.fail("pair.fc_width", "error", f"fc.weight width {fc.ne[0]} != taps x target hidden = {len(tp)} x {h_t}.",
               PICK)
    else:
        r.ok("pair.fc_width", f"fc width {fc.ne[0]} = {len(tp)} taps x {h_t}")

    _check_vocab(d, t, r)
    if DSPARK_MARKER in d.tensors:
        _check_dspark_pair(d, t, r)
    _check_mrope(d, t, r, tarch)
    _check_scale_and_block(d, r, tarch, h_t)
    return r


def _check_mrope(d: GGUFMeta, t: GGUFMeta, r: Report, tarch: str) -> None:
    """pair.mrope: a drafter of an M-RoPE target needs rope sections, or llama.cpp ropes it with plain positions.

    b11434's converter writes ``[n_rot/2, 0, 0, 0]`` for such targets (DFlashModel._target_uses_mrope), and the
    loader then picks M-RoPE for the draft (llama_model_rope_type); drafter GGUFs made before that fix (late
    August 2026) lack the key and draft against image positions they cannot follow."""
    sections = t.get(Keys.of(tarch, Keys.ROPE_DIMENSION_SECTIONS))
    if sections is None or not any(int(x) for x in sections):
        r.ok("pair.mrope", "the target uses no M-RoPE")
        return
    own = d.get(Keys.ROPE_DIMENSION_SECTIONS)
    if own is None or not any(int(x) for x in own):
        r.fail("pair.mrope", "warning", f"the target uses M-RoPE ({tarch}.rope.dimension_sections "
               f"{[int(x) for x in sections]}) but the drafter has no dflash.rope.dimension_sections: a drafter GGUF "
               "from a converter before late August 2026. llama.cpp then ropes the draft with plain positions, so "
               "prompts with images are drafted against the wrong positions and almost never accepted.",
               "Reconvert the drafter with dflash-convert (or llama.cpp b11434's converter), which writes the "
               "degenerate sections [n_rot/2, 0, 0, 0].")
    else:
        r.ok("pair.mrope", f"M-RoPE target; the drafter ropes on the temporal sections {[int(x) for x in own]}")


def _check_dspark_pair(d: GGUFMeta, t: GGUFMeta, r: Report) -> None:
    """pair.dspark_vocab: the Markov head reads a row per target token id, and d2t names target ids."""
    n_t = len(t.get(GKeys.Tokenizer.LIST) or [])
    rows = d.tensors[DSPARK_MARKER].ne[-1]
    problems = []
    if n_t and rows != n_t:
        problems.append(f"{DSPARK_MARKER} has {rows} vocabulary rows but the target has {n_t} tokens (the Markov "
                        "head embeds the previous target token: an id past its rows reads out of bounds)")
    d2t = d.tensors.get("d2t")
    if d2t is not None and n_t and (ids := read_i64(d, "d2t")) is not None and ((ids < 0) | (ids >= n_t)).any():
        problems.append(f"d2t maps draft rows to ids outside the target's {n_t}-token vocabulary")
    if problems:
        r.fail("pair.dspark_vocab", "error", "; ".join(problems) + ".", PICK)
    else:
        r.ok("pair.dspark_vocab", f"Markov head over the target's {n_t}-token vocabulary"
             + (f", d2t ids within it ({d2t.ne[0]} draft rows)" if d2t is not None else ""))


def _first_diff(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"first difference at id {i}: {x!r} vs {y!r}"
    return f"lengths {len(a)} vs {len(b)}"


def _check_vocab(d: GGUFMeta, t: GGUFMeta, r: Report) -> None:
    diffs = []
    for key in (GKeys.Tokenizer.MODEL, GKeys.Tokenizer.PRE):
        if d.get(key) != t.get(key):
            diffs.append(f"{key} {d.get(key)!r} vs {t.get(key)!r}")
    for key in VOCAB_HASH_KEYS:
        a, b = d.get(key), t.get(key)
        a = a.tolist() if hasattr(a, "tolist") else a
        b = b.tolist() if hasattr(b, "tolist") else b
        if a != b:
            diffs.append(f"{key} differs ({_first_diff(a or [], b or [])})")
    if diffs:
        r.fail("pair.vocab", "error", "drafter and target vocabularies differ: " + "; ".join(diffs) + ". "
               "draft-dflash never compares them: expect 'GGML_ASSERT(i01 >= 0 && i01 < ne01)' or nonsense drafts.",
               "Reconvert the drafter with --target pointing at this target's folder (its tokenizer is embedded).")
    else:
        n = len(t.get(GKeys.Tokenizer.LIST) or [])
        r.ok("pair.vocab", f"identical vocabulary ({n} tokens, types, merges)")
    special = []
    for key in (*(f"tokenizer.ggml.{s}" for s in SPECIAL_KEYS), "tokenizer.ggml.add_bos_token"):
        if d.get(key) != t.get(key):
            special.append(f"{key.removeprefix('tokenizer.ggml.')} {d.get(key)!r} vs {t.get(key)!r}")
    if special:
        r.fail("pair.special_tokens", "error", "special tokens differ (drafter vs target): " + "; ".join(special) + ".",
               "Reconvert the drafter against this target's tokenizer files.")
    else:
        r.ok("pair.special_tokens", "bos/eos/pad/unk ids and add_bos agree")
    mask = int_key(d, Keys.MASK_TOKEN_ID)
    tokens = t.get(GKeys.Tokenizer.LIST) or []
    if mask is None:
        r.skip("pair.mask_token", "drafter has no mask token id (see format.mask_token)", "error")
    elif not 0 <= mask < len(tokens):
        r.fail("pair.mask_token", "error", f"mask token id {mask} is outside the target's {len(tokens)}-token "
               "vocabulary: llama-server aborts on the first draft.", PICK)
    else:
        r.ok("pair.mask_token", f"mask token id {mask} ({tokens[mask]!r}) is in the target vocabulary")


def _check_scale_and_block(d: GGUFMeta, r: Report, tarch: str, h_t: int | None) -> None:
    gemma = tarch.startswith("gemma") or str(d.get(prov.key(prov.TARGET_ARCH), "")).lower().startswith("gemma")
    scale = d.get(Keys.EMBEDDING_SCALE)
    if gemma and not isinstance(scale, float):
        r.fail("pair.embedding_scale", "error", "the target is a Gemma but the drafter has no dflash.embedding_scale "
               "(a file from before the Gemma embedding scale): drafts see unscaled embeddings and are rarely "
               "accepted.", "Reconvert the drafter with dflash-convert (it writes sqrt(hidden size)).")
    elif gemma and h_t and not math.isclose(float(scale), math.sqrt(h_t), rel_tol=1e-3):
        r.fail("pair.embedding_scale", "warning", f"dflash.embedding_scale {scale:g} is not sqrt({h_t}) = "
               f"{math.sqrt(h_t):g}.", "Check dflash_config.input_embedding_scale of the drafter checkpoint.")
    else:
        r.ok("pair.embedding_scale", f"embedding scale {scale:g}" if isinstance(scale, float)
             else "no embedding scale (not a Gemma target)")
    src = "" if int_key(d, Keys.BLOCK_SIZE) else " (key absent: llama.cpp default)"
    served = (DSPARK if DSPARK.matches(d) else DFLASH).served_as(d.path, d, "")
    size, limit, spec = served.block_size, served.max_n_max, served.spec_type
    extra = "" if served.required_p_min is None else f" --spec-draft-p-min {served.required_p_min:g}"
    r.info("pair.block_size", f"block_size {size}{src}: --spec-draft-n-max can go up to {limit} (llama.cpp's "
           "default is 3); the fastest value depends on the machine: 'dflash-gguf tune' measures it",
           f"llama-server -m TARGET.gguf -md DRAFTER.gguf --spec-type {spec} --spec-draft-n-max N{extra}")
