"""Which target a drafter was trained for, and whether the target at hand is that model.

Why names matter: a QAT or abliterated target shares config and tokenizer with the vanilla model, so no
structural check fires, yet draft acceptance collapses (0.25% observed with a vanilla-trained Gemma-4
drafter on the QAT target). The evidence is in names, and every producer writes them: llama.cpp's
``convert_hf_to_gguf.py`` copies the model card into ``general.name``, ``general.basename``,
``general.finetune``, ``general.tags`` and ``general.base_model.N.*`` (gguf-py ``Metadata``), GGUF repos on
the Hub carry the same keys, llama-quantize copies them, and Hugging Face folders have the card's YAML
front matter (``base_model``, ``base_model_relation``, ``tags``, ``model_name``). Our own ``dflash_gguf.*``
keys add evidence but are never required.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import PurePath

from ..drafters.findings import PICK, Report
from ..ggufio import GGUFMeta, StringArray
from ..model_card import front_matter, str_list

# Name fragments that mark a model derived from another one (lower-case, matched per name token).
DERIVED_MARKERS: dict[str, str] = {
    "qat": "quantization-aware trained (QAT)",
    "abliterated": "abliterated",
    "uncensored": "an uncensored fine-tune",
    "heretic": "abliterated (heretic)",
    "merge": "merged",
    "merged": "merged",
    "mergekit": "merged",
    "slerp": "merged",
    "distill": "distilled",
    "distilled": "distilled",
    "pruned": "pruned",
    "reap": "expert-pruned (REAP)",
    "unquantized": "re-released from a quantization-aware checkpoint",
}
# Markers that name the same derivation: a target marked by either has what a name with the other expects
# (Google's QAT repos end in "-qat-q4_0-unquantized", their GGUF copies in "-qat-q4_0-gguf").
_MARKER_KIND = {"unquantized": "qat", "merged": "merge", "mergekit": "merge", "slerp": "merge",
                "distilled": "distill", "heretic": "abliterated"}
# Multi-token spellings of a marker ("Quantization Aware", "quantization-aware-training").
_MARKER_PHRASES = {("quantization", "aware"): "qat"}
# Card base_model_relation values that say "other weights than the base": a fine-tune, merge or adapter.
# "quantized" is not among them: the same weights quantized after training serve a drafter fine.
CHILD_RELATIONS = {"merge", "adapter", "finetune"}
# Packaging and encoding tokens that do not change which model a name denotes (gguf, bf16, q4_0, Q4_K_M).
_ENCODING_SUFFIX = re.compile(r"([-_. ](gguf|bf16|f16|f32|fp16|fp32|i?q\d(_[a-z0-9]+)*))+$")
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)([bm])$", re.IGNORECASE)
_SPLIT_RE = re.compile(r"[-_ ./:]+")
HF_URL = "huggingface.co/"


@dataclass(frozen=True)
class ModelName:
    """A repo id or model name split into what the checks compare."""

    raw: str
    repo: str  # lower-case last path part, e.g. "gemma-4-12b-it"
    family: str  # tokens before the size, joined: "gemma4"
    size: str | None  # "12b", "30b-a3b"
    markers: tuple[str, ...]  # derivation markers found
    key: str  # alphanumerics of the name without trailing encoding tokens: "gemma412bit"

    def same_model(self, want: ModelName) -> bool:
        """Names ``want`` itself, possibly behind an org prefix (``bartowski/google_gemma-4-12b-it-GGUF``)."""
        return bool(want.key) and not set(self.markers) - set(want.markers) and self.key.endswith(want.key)


def repo_id(text: str) -> str:
    """``https://huggingface.co/org/name`` -> ``org/name``; anything else unchanged."""
    value = str(text).strip().rstrip("/")
    return value.split(HF_URL, 1)[1] if HF_URL in value else value


def parse_name(text: str) -> ModelName:
    """Split ``org/Name-12B-it-qat`` style names; tolerant of URLs, paths, spaces and encoding suffixes."""
    raw = str(text).strip()
    tail = repo_id(raw)
    repo = PurePath(tail).name.lower() if tail else ""
    tokens = [t for t in _SPLIT_RE.split(repo) if t]
    size_at = next((i for i, t in enumerate(tokens) if _SIZE_RE.match(t)), None)
    size = None
    family = "".join(tokens[:size_at] if size_at is not None else tokens[:2])
    if size_at is not None:
        size = tokens[size_at]
        nxt = tokens[size_at + 1] if size_at + 1 < len(tokens) else ""
        if re.match(r"^a\d+(\.\d+)?b$", nxt):  # MoE active size: 30B-A3B
            size += "-" + nxt
    found = {m for t in tokens for m in DERIVED_MARKERS if t == m or t == m + "ed"}
    found |= {m for (a, b), m in _MARKER_PHRASES.items() if any(tokens[i:i + 2] == [a, b]
                                                                 for i in range(len(tokens) - 1))}
    key = re.sub(r"[^a-z0-9]", "", _ENCODING_SUFFIX.sub("", repo))
    return ModelName(raw, repo, family, size, tuple(sorted(found)), key)


@dataclass(frozen=True)
class KnownPair:
    drafter: str
    target: str
    source: str


@functools.lru_cache(maxsize=1)
def known_pairs() -> tuple[KnownPair, ...]:
    """The shipped data file ``known_pairs.json`` (sources inside it)."""
    text = resources.files(__package__).joinpath("known_pairs.json").read_text(encoding="utf-8")
    data = json.loads(text)
    sources = data.get("sources", {})
    return tuple(KnownPair(p["drafter"], p["target"], sources.get(p.get("source", ""), p.get("source", "")))
                 for p in data["pairs"])


def known_target_for(drafter: str) -> KnownPair | None:
    """The published target of a drafter repo id or name (case-insensitive, org and encoding optional)."""
    want = parse_name(drafter).key
    if not want:
        return None
    for pair in known_pairs():
        if parse_name(pair.drafter).key == want:
            return pair
    return None


def assistant_repo_for(target_repo: str) -> str:
    """The MTP assistant Google publishes for a Gemma-4 checkpoint: ``<target>-assistant`` (google/gemma-4-31B-it
    -> google/gemma-4-31B-it-assistant; the QAT checkpoint's: ...-qat-q4_0-unquantized-assistant)."""
    return repo_id(target_repo).rstrip("/") + "-assistant"


# ------------------------------------------------------------------------------------------- evidence


@dataclass(frozen=True)
class Evidence:
    """One thing a model says about itself, and where it was read (a GGUF key, a card field, a file name)."""

    where: str
    value: str

    def __str__(self) -> str:
        return f"{self.where} {self.value!r}"


@dataclass(frozen=True)
class ModelIdentity:
    """A model's own names and tags, and the models it says it comes from."""

    names: tuple[Evidence, ...] = ()
    tags: tuple[Evidence, ...] = ()
    base_models: tuple[Evidence, ...] = ()
    relation: str | None = None  # card base_model_relation (GGUF files carry none)

    @property
    def empty(self) -> bool:
        return not (self.names or self.tags or self.base_models)

    def derivations(self) -> set[str]:
        """The kinds of derivation its own names and tags mark (``qat``, ``merge``, ``abliterated``...)."""
        return {_MARKER_KIND.get(m, m) for ev in (*self.names, *self.tags) for m in parse_name(ev.value).markers}


def identity_from_gguf(meta: GGUFMeta) -> ModelIdentity:
    """``general.*`` naming keys as gguf-py ``Metadata.set_gguf_meta_model`` writes them, and the file name."""
    names = [Evidence(k, v) for k in ("general.name", "general.basename", "general.finetune")
             if isinstance(v := meta.get(k), str) and v]
    parts = [v for k in ("general.basename", "general.size_label", "general.finetune")
             if isinstance(v := meta.get(k), str) and v]
    if len(parts) > 1:
        names.append(Evidence("general.basename/size_label/finetune", "-".join(parts)))
    names.append(Evidence("file name", meta.path.name))
    tags = meta.get("general.tags")
    tag_list = [Evidence("general.tags", str(x)) for x in (tags if isinstance(tags, list | StringArray) else [])]
    bases = []
    count = meta.get("general.base_model.count")
    for i in range(min(count if isinstance(count, int) else 0, 16)):
        url = meta.get(f"general.base_model.{i}.repo_url")
        name, org = meta.get(f"general.base_model.{i}.name"), meta.get(f"general.base_model.{i}.organization")
        if isinstance(url, str) and url:
            bases.append(Evidence(f"general.base_model.{i}.repo_url", url))
        elif isinstance(name, str) and name:
            value = f"{org}/{name}" if isinstance(org, str) and org else name
            bases.append(Evidence(f"general.base_model.{i}.organization/name", value))
    return ModelIdentity(tuple(names), tuple(tag_list), tuple(bases))


def identity_from_card(name: str | None, card_text: str | None, *, where: str = "repo") -> ModelIdentity:
    """A Hugging Face repo id or folder name plus its card front matter (the fields gguf-py copies)."""
    fm = front_matter(card_text)
    names = [Evidence(where, name)] if name else []
    names += [Evidence(f"README.md {k}", v) for k in ("model_name",) for v in str_list(fm.get(k))]
    tags = [Evidence("README.md tags", v) for v in str_list(fm.get("tags"))]
    bases = [Evidence("README.md base_model", v) for v in str_list(fm.get("base_model"))]
    relation = fm.get("base_model_relation")
    return ModelIdentity(tuple(names), tuple(tags), tuple(bases), relation if isinstance(relation, str) else None)


def card_paired_target(card_text: str | None) -> str | None:
    """The target named in a z-lab drafter card's prose ("must be paired with org/Name")."""
    if not card_text:
        return None
    m = re.search(r"paired with\s+\[?`?([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+?)`?\]?[\s.,)]", card_text)
    return m.group(1) if m else None


def intended_from_identity(drafter: ModelIdentity) -> tuple[str, str] | None:
    """(target, source) from a drafter's own names (a published pair) or its card's ``base_model``."""
    for ev in drafter.names:
        if pair := known_target_for(ev.value):
            return pair.target, f"known published pair {pair.drafter}, matched by {ev} ({pair.source})"
    for ev in drafter.base_models:
        return repo_id(ev.value), f"the drafter's base model, {ev}"
    return None


# ------------------------------------------------------------------------------------------- judgement


@dataclass(frozen=True)
class LineageFinding:
    """One lineage verdict, turned into a check result by :func:`report_lineage`."""

    kind: str  # "derived", "underived", "size", "family", "match", "unmarked", "unknown"
    message: str
    base: str | None = None  # for "derived": the model the target says it derives from


def _marked(target: ModelIdentity, expected: tuple[str, ...] = ()) -> list[tuple[Evidence, tuple[str, ...]]]:
    """Evidence whose markers go beyond ``expected`` (those of the intended target's own name: a drafter
    trained on a QAT or distilled model expects exactly that model)."""
    out = []
    for ev in (*target.names, *target.tags):
        extra = tuple(m for m in parse_name(ev.value).markers if m not in expected)
        if extra:
            out.append((ev, extra))
    return out


def judge(intended: str | None, target: ModelIdentity) -> list[LineageFinding]:
    """Compare the target at hand with the one the drafter was trained for (``None``: not known).

    Derived (an error unless allowed): the target's own names or tags mark it QAT, abliterated, merged...;
    or, when ``intended`` is known, the target names it as its ``base_model`` and is not that model itself.
    The ordinary instruct-from-pretrained link (an ``-it`` target whose card names its ``-pt`` base) and a
    quantized copy of the right target are not evidence of anything.
    """
    if target.empty:
        return [LineageFinding("unknown", "the target carries no name, tag or base_model to compare")]
    found: list[LineageFinding] = []
    want = parse_name(intended) if intended else None
    names = [(ev, parse_name(ev.value)) for ev in target.names]
    marked = _marked(target, want.markers if want is not None else ())
    children = [ev for ev in target.base_models if want is not None and parse_name(ev.value).same_model(want)]
    is_itself = want is not None and any(n.same_model(want) for _, n in names)
    if marked:
        shown = [x for x in marked if x[0] in target.names][:2] + [x for x in marked if x[0] in target.tags][:2]
        said = "; ".join(f"{ev} says {', '.join(DERIVED_MARKERS[m] for m in ms)}" for ev, ms in shown)
        what = sorted({DERIVED_MARKERS[m] for _, ms in marked for m in ms})
        base = repo_id(target.base_models[0].value) if target.base_models else None
        found.append(LineageFinding("derived", f"the target is {' and '.join(what)} ({said})", base))
    elif children and (not is_itself or target.relation in CHILD_RELATIONS):
        rel = f", README.md base_model_relation {target.relation!r}" if target.relation else ""
        own = f" ({names[0][0]})" if names else ""
        found.append(LineageFinding(
            "derived", f"the target{own} names {intended!r} as its base model ({children[0]}{rel}): it is a "
            "model derived from it, not that model itself"))
    if want is not None and names and not found:
        tag_markers = (m for ev in target.tags for m in parse_name(ev.value).markers)
        have = {_MARKER_KIND.get(m, m) for m in (*(m for _, n in names for m in n.markers), *tag_markers)}
        lacking = sorted({_MARKER_KIND.get(m, m) for m in want.markers} - have)
        if lacking:
            missing = " and ".join(DERIVED_MARKERS[m] for m in lacking)
            found.append(LineageFinding(
                "underived", f"the drafter was trained for {intended!r}, which is {missing}, but no name or tag of the "
                f"target says so ({names[0][0]}): it is the model that one derives from, or another derivative"))
    if want is None:
        if not found:
            checked = ", ".join(str(ev) for ev in (*target.names, *target.tags)[:4])
            found.append(LineageFinding("unmarked", f"no QAT/abliterated/merged marker in the target's names or "
                                                    f"tags ({checked})"))
        return found
    same_family = [(ev, n) for ev, n in names if n.family and n.family == want.family]
    if same_family and want.size:
        sizes = {n.size for _, n in same_family if n.size}
        if sizes and want.size not in sizes:
            ev = next(ev for ev, n in same_family if n.size)
            found.append(LineageFinding(
                "size", f"the drafter was trained for {intended!r} ({want.size.upper()}) but the target is "
                f"{sorted(sizes)[0].upper()} ({ev})"))
    bases = [parse_name(ev.value) for ev in target.base_models]
    # a repack's name carries its source's org inside it (bartowski/google_gemma-4-12b-it-GGUF): naming the
    # intended model itself settles the family
    if names and not same_family and not is_itself and not any(b.family == want.family for b in bases):
        found.append(LineageFinding(
            "family", f"the drafter was trained for {intended!r} but the target is named {names[0][0]}"))
    if not found:
        agree = next((ev for ev, n in names if n.same_model(want)), names[0][0] if names else None)
        found.append(LineageFinding("match", f"the target's names agree with {intended!r}"
                                             + (f" ({agree})" if agree else "")))
    return found


def report_lineage(r: Report, findings: list[LineageFinding], intended: str | None, allow_derived: bool) -> None:
    """Turn lineage findings into checks; shared by the GGUF checks and the config-level precheck."""
    for f in findings:
        if intended:
            trained_on = f"the model it was trained on: {intended!r}"
        elif f.base:
            trained_on = f"the model it was trained on, most likely the one this target derives from: {f.base!r}"
        else:
            trained_on = "the model it was trained on (its model card names it)"
        if f.kind == "derived":
            if allow_derived:
                r.fail("lineage.derived_target", "warning", f"allowed by --allow-derived-target: {f.message}. "
                       "Expect lower acceptance than published.", "")
            else:
                who = f"The drafter was trained on {intended!r}; on" if intended else "A DFlash drafter is " \
                    "trained on one exact target model; on"
                r.fail("lineage.derived_target", "error", f"{f.message}. {who} a QAT, abliterated, merged or "
                       "otherwise re-trained derivative draft acceptance collapses (0.25% observed), slower than "
                       "no drafter.", f"Serve the drafter with {trained_on}; or use a drafter trained on this "
                       "target; or pass --allow-derived-target to accept it knowingly.")
        elif f.kind == "underived":
            if allow_derived:
                r.fail("lineage.derived_target", "warning", f"allowed by --allow-derived-target: {f.message}. "
                       "Expect lower acceptance than published.", "")
            else:
                r.fail("lineage.derived_target", "error", f"{f.message}. A drafter trained on a QAT, distilled, "
                       "merged or otherwise re-trained model drafts for those weights; on the original its draft "
                       "acceptance collapses as it does the other way round.", f"Serve the drafter with "
                       f"{trained_on}; or use the drafter made for this target; or pass --allow-derived-target to "
                       "accept it knowingly.")
        elif f.kind == "size":
            r.fail("lineage.size", "error", f.message + ".", PICK)
        elif f.kind == "family":
            r.fail("lineage.family", "warning", f.message + ".", PICK)
        elif f.kind in ("match", "unmarked"):
            r.ok("lineage.derived_target", f.message)
        elif f.kind == "unknown":
            r.skip("lineage.derived_target", f.message, "warning")
