"""Checks of one drafter GGUF against what llama.cpp b11434's DFlash loader requires.

Sources: format reference sections 2-4 and 7 (``src/models/dflash.cpp``, ``src/llama-model.cpp``).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import GGUFValueType as VT
from gguf import Keys as GKeys

from ..dflash_format import (
    ARCH,
    BLOCK_TENSORS,
    DEFAULT_BLOCK_SIZE,
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
    shape_key,
)
from ..ggufio.layout import type_name
from ..ggufio.reader import GGUFMeta
from .report import Report

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


def u32(meta: GGUFMeta, key: str) -> int | None:
    """An integer key only if stored with a usable integer type (wrong types are reported elsewhere)."""
    kv = meta.kv.get(key)
    if kv is None or kv.vtype not in (VT.UINT32, VT.INT32, VT.UINT64, VT.INT64, VT.UINT16, VT.UINT8):
        return None
    return int(kv.value)


def taps(meta: GGUFMeta) -> list[int] | None:
    kv = meta.kv.get(Keys.TARGET_LAYERS)
    if kv is None or kv.vtype != VT.ARRAY or kv.subtype not in (VT.INT32, VT.UINT32, VT.INT64, VT.UINT64):
        return None
    return [int(x) for x in kv.value]


def is_drafter_like(meta: GGUFMeta) -> bool:
    """A DFlash drafter of any layout (mainline, fork, pre-merge), or a file with no architecture at all."""
    return meta.arch in (None, ARCH, "dflash-draft") or any(k.startswith(("dflash.", "dflash-draft.")) for k in meta.kv)


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

    n_layer = u32(d, Keys.BLOCK_COUNT)
    window = u32(d, Keys.SLIDING_WINDOW) or 0
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
        _check_dspark(d, r)
    _check_tensors(d, r, n_layer)
    return r


def dspark_serving(d: GGUFMeta) -> tuple[int, bool]:
    """(largest --spec-draft-n-max draft-dspark keeps, whether the file has a confidence head) of a DSpark file.

    common/speculative.cpp: n-max is clamped to block_size with ``dflash.sample_from_anchor`` (default true) and
    to block_size - 1 without; a missing ``dflash.has_confidence_head`` counts as true there."""
    block = u32(d, Keys.BLOCK_SIZE) or DEFAULT_BLOCK_SIZE
    anchor = d.get(Keys.SAMPLE_FROM_ANCHOR, True) is not False
    return max(1, block if anchor else block - 1), d.get(Keys.HAS_CONFIDENCE_HEAD, True) is not False


def _check_dspark(d: GGUFMeta, r: Report) -> None:
    """format.dspark: the heads and keys draft-dspark reads, and how the file must be served."""
    limit, has_conf = dspark_serving(d)
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


def read_i64(d: GGUFMeta, name: str) -> np.ndarray | None:
    t = d.tensors[name]
    n = int(np.prod(t.ne))
    with open(d.path, "rb") as f:
        f.seek(d.data_offset + t.offset)
        raw = f.read(8 * n)
    return np.frombuffer(raw, dtype="<i8") if len(raw) == 8 * n else None


def _check_dflash2(d: GGUFMeta, r: Report) -> None:
    """format.dflash2: the conv/selector keys the loader needs once the file has a candidate selector."""
    values = {k: u32(d, k) for k in (*DFLASH2_KEYS, Keys.BLOCK_SIZE)}
    h = u32(d, Keys.EMBEDDING_LENGTH) or 0
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
    kernel, group, rank = (u32(d, k) for k in DFLASH2_KEYS[:3])
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
    h = u32(d, Keys.EMBEDDING_LENGTH)
    nh = u32(d, Keys.HEAD_COUNT)
    nkv = u32(d, Keys.HEAD_COUNT_KV) or nh
    hd = u32(d, Keys.KEY_LENGTH) or (h // nh if h and nh else None)
    ff = u32(d, Keys.FEED_FORWARD_LENGTH)
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
