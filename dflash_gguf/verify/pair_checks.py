"""pair.* and lineage.* checks of a drafter GGUF against a target GGUF (or against its own provenance).

Why each: llama-server b11434 compares none of this before serving; mismatches end as aborts
(hidden size, taps, vocabulary, mask id) or as silent acceptance loss (lineage, embedding scale).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from gguf import Keys as GKeys

from .. import fingerprint as efp
from .. import provenance as prov
from ..dflash_format import ARCH, DEFAULT_BLOCK_SIZE, VOCAB_HASH_KEYS, Keys, gguf_taps_outside, vocab_sha256
from ..ggufio.reader import GGUFMeta, read_rows
from ..target_archs import by_gguf
from .format_checks import dspark_serving, read_i64, taps, u32
from .lineage import (
    PICK,
    Evidence,
    ModelIdentity,
    identity_from_gguf,
    intended_from_identity,
    judge,
    report_lineage,
)
from .report import Report

SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id", "eot_token_id")
FP_KEY = prov.key(prov.TARGET_EMBD_FINGERPRINT)


def _check_target_arch(r: Report, tarch: str) -> None:
    """pair.target_arch: can this target's b11434 graph feed a DFlash drafter at all?"""
    known = by_gguf(tarch)
    if known is not None and known.tappable:
        r.ok("pair.target_arch", f"target architecture {tarch!r} publishes layer inputs in b11434")
    elif (known is not None and known.tappable is False) or tarch == ARCH:
        r.fail("pair.target_arch", "error", f"target architecture {tarch!r} cannot feed a DFlash drafter in b11434 "
               "(its graph publishes no layer inputs: 'layer input tensor is null').",
               "Pass the target model GGUF second." if tarch == ARCH else PICK)
    else:
        r.fail("pair.target_arch", "warning", f"target architecture {tarch!r} is not known to publish layer inputs "
               "in llama.cpp b11434.", "Try a short llama-server run with --spec-type draft-dflash before serving.")


def check_pair(d: GGUFMeta, t: GGUFMeta) -> Report:
    """Structural agreement of drafter ``d`` with target ``t``."""
    r = Report()
    tarch = t.arch or "?"
    _check_target_arch(r, tarch)

    h_d, h_t = u32(d, Keys.EMBEDDING_LENGTH), u32(t, Keys.of(tarch, Keys.EMBEDDING_LENGTH))
    n_t = u32(t, Keys.of(tarch, Keys.BLOCK_COUNT))
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
    if "markov_w1.weight" in d.tensors:
        _check_dspark(d, t, r)
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


def _check_dspark(d: GGUFMeta, t: GGUFMeta, r: Report) -> None:
    """pair.dspark_vocab: the Markov head reads a row per target token id, and d2t names target ids."""
    n_t = len(t.get(GKeys.Tokenizer.LIST) or [])
    rows = d.tensors["markov_w1.weight"].ne[-1]
    problems = []
    if n_t and rows != n_t:
        problems.append(f"markov_w1.weight has {rows} vocabulary rows but the target has {n_t} tokens (the Markov "
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
    mask = u32(d, Keys.MASK_TOKEN_ID)
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
    bs = u32(d, Keys.BLOCK_SIZE)
    size = bs if bs else DEFAULT_BLOCK_SIZE
    src = "" if bs else " (key absent: llama.cpp default)"
    limit, spec, extra = size - 1, "draft-dflash", ""
    if "markov_w1.weight" in d.tensors:
        (limit, has_conf), spec = dspark_serving(d), "draft-dspark"
        extra = "" if has_conf else " --spec-draft-p-min 0"
    r.info("pair.block_size", f"block_size {size}{src}: --spec-draft-n-max can go up to {limit} (llama.cpp's "
           "default is 3); the fastest value depends on the machine: 'dflash-gguf tune' measures it",
           f"llama-server -m TARGET.gguf -md DRAFTER.gguf --spec-type {spec} --spec-draft-n-max N{extra}")


def intended_target(d: GGUFMeta) -> tuple[str | None, str]:
    """(target name the drafter was trained for, where that came from).

    A published pair found through the drafter's names, then the drafter card's ``base_model`` (our
    ``drafter.base_model`` key, or ``general.base_model.N.*`` in a file from llama.cpp's converter), win over
    ``target.repo`` and ``target.source``: those name the target the file was *converted against*, which is
    exactly what may be wrong (a drafter trained for a QAT checkpoint, converted with the original).
    """
    ours = [Evidence(k, v) for k in (prov.key(prov.DRAFTER_REPO), prov.key(prov.DRAFTER_SOURCE))
            if isinstance(v := d.get(k), str) and v]
    general = identity_from_gguf(d)
    found = intended_from_identity(ModelIdentity(names=(*ours, *general.names)))
    if found:
        return found
    card = d.get(prov.key(prov.DRAFTER_BASE_MODEL))
    bases = (*((Evidence(prov.key(prov.DRAFTER_BASE_MODEL), card),) if isinstance(card, str) and card else ()),
             *general.base_models)
    if found := intended_from_identity(ModelIdentity(base_models=bases)):
        return found
    repo = d.get(prov.key(prov.TARGET_REPO))
    if isinstance(repo, str) and repo:
        return repo, prov.key(prov.TARGET_REPO)
    src = d.get(prov.key(prov.TARGET_SOURCE))
    name = Path(src.rstrip("/")).name if isinstance(src, str) else ""
    if name and not re.fullmatch(r"[0-9a-f]{40}", name):  # an HF cache snapshots/<sha> dir names nothing
        return name, prov.key(prov.TARGET_SOURCE)
    return None, ""


def check_lineage(d: GGUFMeta, t: GGUFMeta | None, allow_derived: bool) -> Report:
    """lineage.*: intended target vs the target at hand; recorded vocab hash and embedding fingerprint."""
    r = Report()
    intended, source = intended_target(d)
    if intended:
        r.info("lineage.intended_target", f"drafter was trained for {intended!r} (from {source})")
    else:
        r.fail("lineage.intended_target", "warning", "the drafter names no target: no published pair matches its "
               "general.name or file name, and it records no general.base_model or dflash_gguf.target.* key. "
               "Only derivation markers in the target's own names and tags can be judged.",
               "Check the drafter's model card for the target it was trained on.")
    recorded = d.get(prov.key(prov.TARGET_VOCAB_SHA256))
    if isinstance(recorded, str):
        side, actual = (t.path.name, vocab_sha256(t.get)) if t is not None else (d.path.name, vocab_sha256(d.get))
        if actual != recorded:
            r.fail("lineage.vocab_record", "error", f"the vocabulary recorded at conversion "
                   f"({recorded[:12]}...) is not the one in {side} ({actual[:12]}...).", PICK)
        else:
            r.ok("lineage.vocab_record", f"vocabulary hash {recorded[:12]}... matches {side}")
    if t is None:
        # judged alone: compare the published target with the one the file was converted against
        converted = d.get(prov.key(prov.TARGET_REPO))
        from_conversion = source in (prov.key(prov.TARGET_REPO), prov.key(prov.TARGET_SOURCE))
        if not (intended and isinstance(converted, str) and converted and not from_conversion):
            return r
        ident = ModelIdentity(names=(Evidence(prov.key(prov.TARGET_REPO), converted),))
    else:
        ident = identity_from_gguf(t)
    report_lineage(r, judge(intended, ident), intended, allow_derived)
    if t is not None:
        _check_fingerprint(d, t, r)
    return r


def check_target_alone(t: GGUFMeta, allow_derived: bool) -> Report:
    """A target GGUF given without a drafter: can it feed a DFlash drafter, and is it a derived model?"""
    r = Report()
    _check_target_arch(r, t.arch or "?")
    r.skip("pair.drafter", "no drafter GGUF given: judged as a target alone (pair checks not run)")
    report_lineage(r, judge(None, identity_from_gguf(t)), None, allow_derived)
    return r


def target_fingerprint(t: GGUFMeta) -> efp.Fingerprint | None:
    """Fingerprint of the target GGUF's token_embd (reads only the sampled rows)."""
    emb = t.tensors.get("token_embd.weight")
    if emb is None or len(emb.ne) != 2:
        return None
    rows = read_rows(t, emb.name, efp.sample_rows(emb.ne[1]))
    return efp.compute(rows, emb.ne[1])


def _check_fingerprint(d: GGUFMeta, t: GGUFMeta, r: Report) -> None:
    text = d.get(FP_KEY)
    if text is None:
        r.skip("lineage.fingerprint", f"the drafter records no {FP_KEY}; weights not compared", "warning")
        return
    rec = efp.decode(text)
    if rec is None:
        r.fail("lineage.fingerprint", "warning", f"{FP_KEY} is not an efp1 fingerprint.", "Reconvert the drafter.")
        return
    got = target_fingerprint(t)
    if got is None:
        r.skip("lineage.fingerprint", "the target GGUF has no 2-D token_embd.weight", "warning")
        return
    if (got.n_vocab, got.n_embd, got.values.shape) != (rec.n_vocab, rec.n_embd, rec.values.shape):
        r.fail("lineage.fingerprint", "error", f"recorded target embedding is {rec.n_vocab}x{rec.n_embd}, this "
               f"target's is {got.n_vocab}x{got.n_embd}.", PICK)
        return
    cos = efp.row_cosines(rec, got)
    mean, low = float(cos.mean()), float(cos.min())
    msg = f"token_embd vs the fingerprint recorded at conversion: mean row cosine {mean:.4f}, min {low:.4f}"
    if mean >= 0.98:
        r.ok("lineage.fingerprint", msg + " (same weights within quantization noise)")
    elif mean >= 0.9:
        r.fail("lineage.fingerprint", "warning", msg + ": close but not the same weights (fine-tuned or QAT "
               "derivative?).", "Serve with the exact target the drafter was converted against.")
    else:
        r.fail("lineage.fingerprint", "error", msg + ": a different model.", PICK)

