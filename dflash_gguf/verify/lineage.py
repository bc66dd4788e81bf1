"""Which target a drafter was trained for, and whether the target at hand is that model.

Why names matter: a QAT or abliterated target shares config and tokenizer with the vanilla model, so
no structural check fires, yet acceptance collapses (failure-modes S1). The evidence is in names:
repo ids, GGUF ``general.*`` keys, model-card ``base_model``/``base_model_relation``.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import PurePath

# Name fragments that mark a model derived from another one (lower-case, matched per name token run).
DERIVED_MARKERS: dict[str, str] = {
    "qat": "quantization-aware trained (QAT)",
    "abliterated": "abliterated",
    "uncensored": "uncensored fine-tune",
    "heretic": "abliterated (heretic)",
    "merge": "merged",
    "merged": "merged",
    "slerp": "merged",
    "distill": "distilled",
    "distilled": "distilled",
    "pruned": "pruned",
    "reap": "expert-pruned (REAP)",
    "unquantized": "re-released from a quantized checkpoint",
}
# base_model_relation values (Hub model cards) that mean "not the same weights".
DERIVED_RELATIONS = {"quantized", "merge", "adapter", "finetune"}

_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)([bm])$", re.IGNORECASE)
_SPLIT_RE = re.compile(r"[-_ ./:]+")


@dataclass(frozen=True)
class ModelName:
    """A repo id or model name split into what the checks compare."""

    raw: str
    repo: str  # lower-case last path part, e.g. "gemma-4-12b-it"
    family: str  # tokens before the size, joined: "gemma4"
    size: str | None  # "12b", "30b-a3b"
    markers: tuple[str, ...]  # derivation markers found

    @property
    def key(self) -> str:
        return re.sub(r"[^a-z0-9]", "", self.repo)


def parse_name(text: str) -> ModelName:
    """Split ``org/Name-12B-it-qat`` style names; tolerant of URLs, paths and spaces."""
    raw = str(text).strip()
    tail = raw.rstrip("/")
    if "huggingface.co/" in tail:
        tail = tail.split("huggingface.co/", 1)[1]
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
    markers = tuple(sorted({m for t in tokens for m in DERIVED_MARKERS if t == m or t.startswith(m + "ed")}))
    return ModelName(raw, repo, family, size, markers)


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
    """The published target of a drafter repo id or name (case-insensitive, org optional)."""
    want = parse_name(drafter).key
    if not want:
        return None
    for pair in known_pairs():
        if parse_name(pair.drafter).key == want:
            return pair
    return None


@dataclass
class TargetIdentity:
    """Everything that names the target at hand: its own names and the models it says it comes from."""

    names: list[str] = field(default_factory=list)
    base_models: list[str] = field(default_factory=list)
    relation: str | None = None  # model-card base_model_relation, when known

    def parsed(self) -> list[ModelName]:
        return [parse_name(n) for n in self.names if n]


@dataclass(frozen=True)
class LineageFinding:
    """One lineage verdict, turned into a check result by the caller."""

    kind: str  # "derived", "size", "family", "match", "unknown", "other"
    message: str


def judge(intended: str | None, target: TargetIdentity) -> list[LineageFinding]:
    """Compare the intended target name with the target at hand; empty list when nothing is known."""
    found: list[LineageFinding] = []
    names = target.parsed()
    if not names and not target.base_models:
        return [LineageFinding("unknown", "the target carries no name or base_model to compare")]
    markers = sorted({m for n in names for m in n.markers})
    want = parse_name(intended) if intended else None
    bases = [parse_name(b) for b in target.base_models]
    descends = want is not None and any(b.key == want.key for b in bases) and all(n.key != want.key for n in names)
    if markers:
        what = ", ".join(DERIVED_MARKERS[m] for m in markers)
        found.append(LineageFinding("derived", f"the target {names[0].raw!r} is {what}"))
    elif descends:
        rel = f" (base_model_relation: {target.relation})" if target.relation else ""
        found.append(LineageFinding(
            "derived", f"the target {names[0].raw if names else '?'!r} is derived from {intended!r}{rel}, "
            "not that model itself"))
    elif target.relation in DERIVED_RELATIONS and want is not None and any(b.key == want.key for b in bases):
        found.append(LineageFinding("derived", f"the target's card says base_model_relation: {target.relation}"))
    if want is None:
        return found
    same_family = [n for n in names if n.family and n.family == want.family]
    if same_family and want.size:
        sizes = {n.size for n in same_family if n.size}
        if sizes and want.size not in sizes:
            found.append(LineageFinding(
                "size", f"the drafter was trained for {intended!r} ({want.size.upper()}) but the target is "
                f"{same_family[0].raw!r} ({sorted(sizes)[0].upper()})"))
    if names and not same_family and not any(b.family == want.family for b in bases):
        found.append(LineageFinding(
            "family", f"the drafter was trained for {intended!r} but the target is named {names[0].raw!r}"))
    if not found:
        found.append(LineageFinding("match", f"the target's names agree with {intended!r}"))
    return found


def card_base_model(card_text: str | None) -> tuple[list[str], str | None]:
    """``base_model`` entries and ``base_model_relation`` from a model card's YAML header (no YAML lib)."""
    if not card_text or not card_text.startswith("---"):
        return [], None
    end = card_text.find("\n---", 3)
    header = card_text[3:end if end > 0 else len(card_text)]
    bases: list[str] = []
    relation = None
    lines = header.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^base_model:\s*(.*)$", line)
        if m:
            value = m.group(1).strip().strip("'\"")
            if value.startswith("["):
                bases += [v.strip().strip("'\"") for v in value.strip("[]").split(",") if v.strip()]
            elif value:
                bases.append(value)
            else:
                for nxt in lines[i + 1:]:
                    item = re.match(r"^\s*-\s*(.+)$", nxt)
                    if not item:
                        break
                    bases.append(item.group(1).strip().strip("'\""))
        m = re.match(r"^base_model_relation:\s*(\S+)", line)
        if m:
            relation = m.group(1).strip("'\"")
    return bases, relation


def card_paired_target(card_text: str | None) -> str | None:
    """The target named in a z-lab drafter card's prose ("must be paired with org/Name")."""
    if not card_text:
        return None
    m = re.search(r"paired with\s+\[?`?([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+?)`?\]?[\s.,)]", card_text)
    return m.group(1) if m else None
