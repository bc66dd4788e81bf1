"""Checks of a Gemma-4 MTP assistant GGUF (general.architecture ``gemma4-assistant``), alone and with its target.

The DFlash checks (format_checks, pair_checks) do not apply: the assistant has no taps, mask token or block. What
llama.cpp b11434 needs of it is read from src/models/gemma4-assistant.cpp (loader and graph), llama-model.cpp (the
shared KV cache) and common/speculative.cpp (draft-mtp): the keys and tensors its loader creates, a sliding and a
full layer, K and V head sizes equal, ``embedding_length_out`` (the target's width) other than its own; and, with
the target, the same vocabulary, hidden size, head sizes and KV heads as the target layers whose cache it reads
(its sliding layers read the target's last-but-one layer, its full layers the last).
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType as VT

from ...ggufio.reader import GGUFMeta, int_key
from ..findings import Report
from .rules import GGUF_ARCH, SPEC_TYPE

RECONVERT = "Reconvert the assistant with dflash-convert --drafter ASSISTANT --target TARGET."
PICK = "Pick the assistant published for this target (google/gemma-4-<size>-it-assistant for google/gemma-4-<size>-it)."
TARGET_ARCH = "gemma4"
# keys b11434's loader reads without a default (llama_model_gemma4_assistant::load_arch_hparams and the generic ones)
REQUIRED_U32 = ("block_count", "embedding_length", "embedding_length_out", "nextn_predict_layers",
                "attention.head_count", "attention.key_length", "attention.value_length",
                "attention.key_length_swa", "attention.value_length_swa", "attention.sliding_window",
                "feed_forward_length", "context_length")
_VOCAB_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
               "tokenizer.ggml.merges")
_SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id", "eot_token_id",
                 "add_bos_token")


def _key(arch: str, name: str) -> str:
    return f"{arch}.{name}"


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def per_layer(meta: GGUFMeta, arch: str, name: str, n_layer: int) -> list[int] | None:
    """A key llama.cpp reads per layer (a scalar or an array of n_layer integers)."""
    kv = meta.kv.get(_key(arch, name))
    if kv is None:
        return None
    if kv.vtype == VT.ARRAY:
        values = [int(v) for v in _plain(kv.value)]
        return values if len(values) == n_layer else None
    value = int_key(meta, _key(arch, name))
    return None if value is None else [value] * n_layer


def swa_pattern(meta: GGUFMeta, arch: str) -> list[bool] | None:
    kv = meta.kv.get(_key(arch, "attention.sliding_window_pattern"))
    if kv is None or kv.vtype != VT.ARRAY:
        return None
    return [bool(v) for v in _plain(kv.value)]


def expected_tensors(d: GGUFMeta) -> dict[str, tuple[int, ...]] | None:
    """GGUF name -> ne of every tensor b11434's assistant loader creates (None when the keys are unusable)."""
    a = GGUF_ARCH
    n_layer, h, bb = int_key(d, _key(a, "block_count")), int_key(d, _key(a, "embedding_length")), \
        int_key(d, _key(a, "embedding_length_out"))
    pattern = swa_pattern(d, a)
    vocab = len(d.get("tokenizer.ggml.tokens") or [])
    if n_layer is None or h is None or bb is None or pattern is None or len(pattern) != n_layer:
        return None
    nh = per_layer(d, a, "attention.head_count", n_layer)
    ff = per_layer(d, a, "feed_forward_length", n_layer)
    hd_full, hd_swa = int_key(d, _key(a, "attention.key_length")), int_key(d, _key(a, "attention.key_length_swa"))
    if nh is None or ff is None or hd_full is None or hd_swa is None:
        return None
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (h, vocab), "output_norm.weight": (h,),
                                       "nextn.pre_projection.weight": (2 * bb, h),
                                       "nextn.post_projection.weight": (h, bb)}
    if not all(pattern):
        out["rope_freqs.weight"] = (hd_full // 2,)
    for i, swa in enumerate(pattern):
        hd, b = hd_swa if swa else hd_full, f"blk.{i}."
        out.update({b + "attn_norm.weight": (h,), b + "attn_q.weight": (h, hd * nh[i]),
                    b + "attn_output.weight": (hd * nh[i], h), b + "attn_q_norm.weight": (hd,),
                    b + "post_attention_norm.weight": (h,), b + "layer_output_scale.weight": (1,),
                    b + "ffn_norm.weight": (h,), b + "ffn_gate.weight": (h, ff[i]), b + "ffn_up.weight": (h, ff[i]),
                    b + "ffn_down.weight": (ff[i], h), b + "post_ffw_norm.weight": (h,)})
    return out


def check_drafter(d: GGUFMeta, t: GGUFMeta | None) -> Report:
    """format.* of the assistant, then pair.* with the target when one is given and the file itself passed."""
    r = check_assistant_format(d)
    if t is not None and not r.errors:
        r.extend(check_assistant_pair(d, t))
    elif t is None:
        r.skip("pair.target", "no target GGUF given: pair checks (vocabulary, hidden size, KV geometry) not run",
               "error")
    return r


def check_assistant_format(d: GGUFMeta) -> Report:
    """format.*: keys, the layer mix, tensors and shapes from the file alone, and the spec type to serve with."""
    r, a = Report(), GGUF_ARCH
    r.ok("format.arch", f"architecture '{a}' (a Gemma-4 MTP assistant; llama.cpp b11434 tested)")
    missing = [k for k in REQUIRED_U32 if k != "feed_forward_length" and int_key(d, _key(a, k)) is None]
    if _key(a, "feed_forward_length") not in d.kv:
        missing.append("feed_forward_length")
    if swa_pattern(d, a) is None:
        missing.append("attention.sliding_window_pattern")
    if missing:
        r.fail("format.keys", "error", f"{d.path.name} lacks (or mistypes) {', '.join(_key(a, k) for k in missing)}; "
               "llama.cpp b11434's loader stops with 'key not found'.", RECONVERT)
        return r
    r.ok("format.keys", "every key the b11434 assistant loader reads is present")
    n_layer, h = int_key(d, _key(a, "block_count")), int_key(d, _key(a, "embedding_length"))
    bb, nextn = int_key(d, _key(a, "embedding_length_out")), int_key(d, _key(a, "nextn_predict_layers"))
    pattern = swa_pattern(d, a) or []
    problems = []
    if len(pattern) != n_layer:
        problems.append(f"sliding_window_pattern has {len(pattern)} entries for {n_layer} layers")
    if not any(pattern):
        problems.append("no sliding layer: llama-server aborts at start-up with GGML_ASSERT(hparams.is_swa_any())")
    if all(pattern):
        problems.append("no full layer: rope_freqs has no layer to belong to ('wrong number of tensors')")
    if nextn != n_layer:
        problems.append(f"nextn_predict_layers {nextn} is not the block count {n_layer} (the graph runs that many)")
    if bb == h:
        problems.append("embedding_length_out equals embedding_length: the loader throws \"Gemma 4 assistant "
                        "requires embedding_length_out to carry the target hidden size\"")
    for full, swa in (("key_length", "value_length"), ("key_length_swa", "value_length_swa")):
        if int_key(d, _key(a, f"attention.{full}")) != int_key(d, _key(a, f"attention.{swa}")):
            problems.append(f"attention.{full} differs from attention.{swa}: the loader requires K and V head "
                            "sizes to be equal")
    if problems or n_layer is None:
        r.fail("format.assistant", "error", f"{d.path.name}: " + "; ".join(problems) + ".", RECONVERT)
    else:
        n_swa = sum(pattern)
        r.ok("format.assistant", f"{n_layer} layers ({n_swa} sliding, {n_layer - n_swa} full), hidden {h}, "
             f"backbone {bb}")
    want = expected_tensors(d)
    if want is None:
        r.fail("format.tensors", "error", f"{d.path.name}: the per-layer keys (head_count, feed_forward_length) do "
               "not give one value per layer, so the tensor set cannot be known.", RECONVERT)
        return r
    have = set(d.tensors)
    optional = {"masked_embd_centroids.weight", "masked_embd_ordering"}
    missing_t, extra = sorted(set(want) - have), sorted(have - set(want) - optional)
    if missing_t or extra:
        r.fail("format.tensors", "error", f"{d.path.name}: tensor set differs from the one b11434's assistant loader "
               f"creates (missing {missing_t[:6]}, unexpected {extra[:6]}); it fails with 'missing tensor' or "
               "'wrong number of tensors'.", RECONVERT)
    else:
        r.ok("format.tensors", f"the b11434 assistant tensor set ({len(want)} tensors; no K/V: it reads the "
             "target's KV cache)")
    wrong = [f"{n} {list(d.tensors[n].ne)} (want {list(ne)})" for n, ne in want.items()
             if n in d.tensors and tuple(d.tensors[n].ne) != ne]
    if wrong:
        r.fail("format.shapes", "error", f"{d.path.name}: tensors with shapes the keys do not imply: {wrong[:4]}; "
               "llama.cpp fails with 'wrong shape'.", RECONVERT)
    else:
        r.ok("format.shapes", "every tensor has the shape the keys imply")
    r.info("format.spec_type", f"serve with --spec-type {SPEC_TYPE}: llama-server does not infer it from this file "
           "(common_speculative_types_from_gguf knows only DFlash/DSpark/EAGLE-3 drafters)")
    return r


def check_assistant_pair(d: GGUFMeta, t: GGUFMeta) -> Report:
    """pair.*: what b11434 takes from the target: vocabulary, hidden state width, and the KV cache geometry."""
    r, a, ta = Report(), GGUF_ARCH, t.arch or "?"
    if ta != TARGET_ARCH:
        r.fail("pair.target_arch", "error", f"{t.path.name} is a {ta!r} model; a Gemma-4 assistant drafts only for a "
               "Gemma-4 target (it reads its KV cache, token embeddings and hidden state).", PICK)
        return r
    r.ok("pair.target_arch", "target architecture gemma4")
    diffs = [k for k in _VOCAB_KEYS if _plain(d.get(k)) != _plain(t.get(k))]
    if diffs:
        r.fail("pair.vocab", "error", f"the assistant's vocabulary differs from the target's ({', '.join(diffs)}); "
               "b11434 writes the assistant's own tokenizer and reads its drafts as target token ids.", PICK)
    else:
        r.ok("pair.vocab", f"identical vocabulary ({len(t.get('tokenizer.ggml.tokens') or [])} tokens)")
    special = [k for k in _SPECIAL_KEYS if d.get(f"tokenizer.ggml.{k}") != t.get(f"tokenizer.ggml.{k}")]
    if special:
        r.fail("pair.special_tokens", "error", f"special tokens differ (assistant vs target): {', '.join(special)}.",
               PICK)
    else:
        r.ok("pair.special_tokens", "bos/eos/pad/unk ids and add_bos agree")
    bb, h_t = int_key(d, _key(a, "embedding_length_out")), int_key(t, _key(ta, "embedding_length"))
    if bb != h_t:
        r.fail("pair.assistant_backbone", "error", f"embedding_length_out {bb} is not the target's embedding_length "
               f"{h_t}: llama.cpp b11434 aborts with ggml_can_mul_mat on nextn.pre_projection (and draft-mtp asserts "
               "the widths match).", PICK)
    else:
        r.ok("pair.assistant_backbone", f"embedding_length_out {bb} = the target's hidden size")
    n_t = int_key(t, _key(ta, "block_count")) or 0
    t_pattern = swa_pattern(t, ta)
    if t_pattern is None or n_t < 2 or len(t_pattern) != n_t or not (t_pattern[-2] and not t_pattern[-1]):
        r.fail("pair.assistant_target_layers", "error", f"{t.path.name}: the target's last two layers are not a "
               "sliding and a full layer, whose KV caches the assistant's sliding and full layers read.", PICK)
        return r
    r.ok("pair.assistant_target_layers", f"target layers {n_t - 2} (sliding) and {n_t - 1} (full) give the KV "
         "cache the assistant reads")
    head = []
    for name in ("key_length", "key_length_swa"):
        ours, theirs = int_key(d, _key(a, f"attention.{name}")), int_key(t, _key(ta, f"attention.{name}"))
        if ours != theirs:
            head.append(f"attention.{name} {ours} vs {theirs}")
    if head:
        r.fail("pair.assistant_head_dim", "error", "head sizes differ from the target layers whose KV cache the "
               f"assistant reads ({'; '.join(head)}): llama.cpp b11434 aborts on the view of the target's K cache.",
               PICK)
    else:
        r.ok("pair.assistant_head_dim", "head sizes equal the target's (sliding and full)")
    pattern = swa_pattern(d, a) or []
    kv_d = per_layer(d, a, "attention.head_count_kv", len(pattern))
    kv_t = per_layer(t, ta, "attention.head_count_kv", n_t)
    if kv_d is None or kv_t is None:
        r.skip("pair.assistant_kv_heads", "KV head counts not readable on both sides", "error")
        return r
    bad = [f"layer {i} ({'sliding' if swa else 'full'}): {kv_d[i]} vs {kv_t[n_t - 2 if swa else n_t - 1]}"
           for i, swa in enumerate(pattern) if kv_d[i] != kv_t[n_t - 2 if swa else n_t - 1]]
    if bad:
        r.fail("pair.assistant_kv_heads", "error", f"KV head counts differ from the target layers the assistant reads "
               f"({'; '.join(bad[:3])}): llama.cpp b11434 accepts it without a word, and the drafts are noise.", PICK)
    else:
        r.ok("pair.assistant_kv_heads", "KV head counts equal the target's")
    return r
