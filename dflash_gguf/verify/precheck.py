"""Config-level precheck: drafter config.json + target config.json + repo ids/model cards, before any download.

Why: the pipeline fetches only configs and cards first; hidden size, tap range, mask id and lineage
(QAT/derived targets) can all be judged from them in seconds, before gigabytes of weights arrive.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..dflash_format import hf_taps_outside
from ..errors import VerifyError
from ..jsonfile import read_json
from .lineage import PICK, card_paired_target, identity_from_card, intended_from_identity, judge, report_lineage
from .report import Report

UNTAPPABLE_PREFIXES = ("Gemma3", "Gemma2", "GemmaFor", "Gemma3n")


def _load(cfg: dict[str, Any] | Path | str, what: str) -> dict[str, Any]:
    if isinstance(cfg, dict):
        return cfg
    path = Path(cfg)
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        raise VerifyError(f"{what} {path}: cannot read it as JSON ({e}).") from e
    if not isinstance(data, dict):
        raise VerifyError(f"{what} {path}: not a JSON object.")
    return data


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def precheck(
    drafter_config: dict[str, Any] | Path | str,
    target_config: dict[str, Any] | Path | str,
    *,
    drafter_repo: str | None = None,
    target_repo: str | None = None,
    drafter_card: str | None = None,
    target_card: str | None = None,
    allow_derived_target: bool = False,
) -> Report:
    """Judge a pair from configs and cards only; same check ids as the GGUF checks.

    Raises:
        VerifyError: a config cannot be read.
    """
    d = _load(drafter_config, "drafter config")
    t_root = _load(target_config, "target config")
    t = {**t_root, **t_root.get("text_config", {})} if isinstance(t_root.get("text_config"), dict) else t_root
    dcfg = d.get("dflash_config") if isinstance(d.get("dflash_config"), dict) else {}
    r = Report(inputs={"drafter": drafter_repo or "", "target": target_repo or "", "stage": "precheck"})

    archs = t_root.get("architectures") or t.get("architectures") or []
    arch = archs[0] if archs and isinstance(archs[0], str) else ""
    if arch.startswith(UNTAPPABLE_PREFIXES):
        r.fail("pair.target_arch", "error", f"target architecture {arch} publishes no layer inputs in llama.cpp "
               "b11434 ('layer input tensor is null').", PICK)
    else:
        r.ok("pair.target_arch", f"target architecture {arch or '?'}")

    h_d, h_t = _int(d.get("hidden_size")), _int(t.get("hidden_size"))
    if h_d is None or h_t is None:
        r.skip("pair.hidden_size", "hidden_size missing on one side", "error")
    elif h_d != h_t:
        r.fail("pair.hidden_size", "error", f"drafter hidden_size {h_d} != target hidden_size {h_t}.", PICK)
    else:
        r.ok("pair.hidden_size", f"hidden size {h_d} on both sides")

    n_t = _int(t.get("num_hidden_layers"))
    ids = dcfg.get("target_layer_ids", d.get("target_layer_ids"))
    if not isinstance(ids, list) or not ids or not all(_int(x) is not None for x in ids):
        r.fail("pair.taps", "error", "the drafter config has no target_layer_ids (dflash_config or top level).",
               "This checkpoint cannot be converted for llama.cpp b11434.")
    elif n_t is not None:
        bad = hf_taps_outside(ids, n_t)
        if bad:
            r.fail("pair.taps", "error", f"drafter target_layer_ids {ids} include {bad}, outside 0..{n_t - 2} for a "
                   f"{n_t}-layer target (llama.cpp taps the input of layer id+1).", PICK)
        else:
            r.ok("pair.taps", f"target_layer_ids {ids} fit the {n_t}-layer target")
    n_decl = _int(d.get("num_target_layers"))
    if n_decl is not None and n_t is not None and n_decl != n_t:
        r.fail("pair.num_target_layers", "error", f"drafter num_target_layers {n_decl} != target "
               f"num_hidden_layers {n_t}.", PICK)

    mask = _int(dcfg.get("mask_token_id"))
    v_t = _int(t.get("vocab_size"))
    if mask is None:
        r.fail("format.mask_token", "error", "no dflash_config.mask_token_id: b11434 writes no drafter mask id.",
               "Use a drafter revision with dflash_config.mask_token_id.")
    elif v_t is not None and not 0 <= mask < v_t:
        r.fail("pair.mask_token", "error", f"mask_token_id {mask} is outside the target vocab_size {v_t}.", PICK)
    else:
        r.ok("pair.mask_token", f"mask token id {mask}")
    v_d = _int(d.get("vocab_size"))
    if v_d is not None and v_t is not None and v_d != v_t:
        r.fail("pair.vocab", "warning", f"drafter vocab_size {v_d} != target vocab_size {v_t}: the embedded token "
               "list is padded to the drafter's size and will differ from the target GGUF's.", PICK)

    bs = _int(dcfg.get("block_size", d.get("block_size"))) or 16
    r.info("pair.block_size", f"block_size {bs}: --spec-draft-n-max can go up to {bs - 1}; 'dflash-gguf tune' "
           "measures the fastest")

    drafter_ident = identity_from_card(drafter_repo, drafter_card)
    intended, source = intended_from_identity(drafter_ident) or (None, "")
    if intended is None and (named := card_paired_target(drafter_card)):
        intended, source = named, "the drafter's model card text"
    if intended:
        r.info("lineage.intended_target", f"drafter was trained for {intended!r} (from {source})")
    else:
        r.fail("lineage.intended_target", "warning", "cannot tell which target the drafter was trained for (not a "
               "known published drafter; its card names no base_model or paired target). Only derivation markers "
               "in the target's own names and tags can be judged.", "Check the drafter's model card by hand.")
    target_ident = identity_from_card(target_repo, target_card)
    report_lineage(r, judge(intended, target_ident), intended, allow_derived_target)
    return r
