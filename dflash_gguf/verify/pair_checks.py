"""The checks every drafter family shares: lineage.* (a drafter against the target at hand, or against its own
provenance) and pair.target_arch, and a target judged alone. Each family's own pair.* checks are in its package.

Why: llama-server b11434 compares none of this before serving; a drafter on the wrong target ends as an abort or as
silent acceptance loss.
"""

from __future__ import annotations

import re
from pathlib import Path

from .. import fingerprint as efp
from .. import provenance as prov
from ..drafters import check_target_arch
from ..drafters.findings import Report
from ..ggufio.reader import GGUFMeta, read_rows
from ..vocab_hash import vocab_sha256
from .lineage import (
    PICK,
    Evidence,
    ModelIdentity,
    identity_from_gguf,
    intended_from_identity,
    judge,
    report_lineage,
)

FP_KEY = prov.key(prov.TARGET_EMBD_FINGERPRINT)


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
    check_target_arch(r, t.arch or "?")
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

