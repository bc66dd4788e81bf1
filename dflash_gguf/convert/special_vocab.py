"""Special-token ids, add-bos/eos flags, merges and chat template of a target tokenizer dir.

Mirrors the rules of gguf-py's ``SpecialVocab`` in llama.cpp b11434 (``gguf-py/gguf/vocab.py``):
merges from tokenizer.json (pairs with spaces re-encoded as U+0120+), special ids looked up among
tokenizer.json's ``added_tokens`` by the contents tokenizer_config.json names, then filled from
config.json ``*_token_id`` (also under ``text_config``), add-flags from the post-processor template
then tokenizer_config, chat template from tokenizer_config then chat_template.jinja/.json.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..ggufio import GGUFPlan, StringArray
from ..jsonfile import array_runs, read_json

log = logging.getLogger(__name__)

# Key names gguf-py's writer uses for each special-token type (Keys.Tokenizer).
_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "sep": "seperator_token_id",
            "pad": "padding_token_id", "cls": "cls_token_id", "mask": "mask_token_id", "eot": "eot_token_id",
            "eom": "eom_token_id"}
_ADD_KEYS = {"bos": "add_bos_token", "eos": "add_eos_token", "sep": "add_sep_token"}


@dataclass
class SpecialTokens:
    merges: Sequence[str] = ()
    ids: dict[str, int] = field(default_factory=dict)
    add: dict[str, bool] = field(default_factory=dict)
    chat_template: str | list[dict[str, str]] | None = None
    lowercase: bool | None = None
    strip_accents: bool | None = None

    def add_to(self, plan: GGUFPlan) -> None:
        if self.merges:
            plan.add_array("tokenizer.ggml.merges", self.merges)
        for typ, tid in self.ids.items():
            plan.add_uint32(f"tokenizer.ggml.{_ID_KEYS[typ]}", tid)
        for typ, flag in self.add.items():
            if typ in _ADD_KEYS:
                plan.add_bool(f"tokenizer.ggml.{_ADD_KEYS[typ]}", flag)
        if isinstance(self.chat_template, str):
            plan.add_string("tokenizer.chat_template", self.chat_template)
        elif self.chat_template:
            for entry in self.chat_template:  # named templates, as gguf-py's add_chat_template stores them
                name, template = entry.get("name"), entry.get("template")
                if name == "default":
                    plan.add_string("tokenizer.chat_template", template or "")
                elif name and template:
                    plan.add_string(f"tokenizer.chat_template.{name}", template)
            names = [e["name"] for e in self.chat_template if e.get("name") not in (None, "default")]
            plan.add_array("tokenizer.chat_templates", names)
        if self.lowercase is not None:
            plan.add_bool("tokenizer.ggml.normalizer.lowercase", self.lowercase)
        if self.strip_accents is not None:
            plan.add_bool("tokenizer.ggml.normalizer.strip_accents", self.strip_accents)


def _merges(tokenizer: dict[str, Any]) -> StringArray:
    """The merges as GGUF strings, encoded a run at a time (515k of them as Python strings are ~40 MB)."""
    def runs() -> Iterator[list[str]]:
        pairs: bool | None = None  # the first merge decides the form, as in gguf-py
        for run in array_runs(tokenizer.get("model", {}).get("merges")):
            if pairs is None:
                pairs = bool(run) and not isinstance(run[0], str)
            if not pairs:
                yield run
            else:  # [left, right] pairs (transformers >= 4.45): a space inside a part becomes U+0120
                yield [f"{left.replace(' ', chr(0x120))} {right.replace(' ', chr(0x120))}" for left, right in run]

    return StringArray.from_runs(runs())


def _normalizer_flags(st: SpecialTokens, norm: dict[str, Any]) -> None:
    kind = norm.get("type")
    if kind == "Lowercase":
        st.lowercase = True
    elif kind == "StripAccents":
        st.strip_accents = True
    elif kind == "BertNormalizer":
        st.lowercase = norm.get("lowercase", st.lowercase)
        st.strip_accents = norm.get("strip_accents", st.strip_accents)
    elif kind == "Sequence":
        for sub in norm.get("normalizers", []):
            _normalizer_flags(st, sub)


def _template_flags(st: SpecialTokens, proc: dict[str, Any], cfg: dict[str, Any] | None,
                    types: list[str]) -> None:
    """Infer add_bos/add_eos/add_sep from a TemplateProcessing, updating ``cfg`` like gguf-py does."""
    def special(item: dict[str, Any]) -> str | None:
        return item.get("SpecialToken", {}).get("id")

    single, pair = proc.get("single", []), proc.get("pair", [])
    bos, cls = (cfg or {}).get("bos_token"), (cfg or {}).get("cls_token")
    eos, sep = (cfg or {}).get("eos_token"), (cfg or {}).get("sep_token")
    first = last = None
    if len(single) > 1:
        if first := special(single[0]):
            if not cfg:
                bos = first
            elif first not in (bos, cls):
                if not bos:
                    cfg["bos_token"] = bos = first
                if not cls:
                    cfg["cls_token"] = cls = first
            st.add["bos"] = first in (bos, cls)
        if last := special(single[-1]):
            if not cfg:
                eos = last
            elif last != eos:
                for extra in ("eot", "eom"):
                    if extra not in types:
                        types.append(extra)
                        cfg[f"{extra}_token"] = eos
                        break
                cfg["eos_token"] = eos = last
            st.add["eos"] = last == eos
    if not pair:
        return
    start = 1 if first and special(pair[0]) == first else 0
    stop = -1 if last and special(pair[-1]) == last else None
    middle = pair[start:stop]
    if not middle:
        return
    a, b = middle[0].get("Sequence", {}).get("id"), middle[-1].get("Sequence", {}).get("id")
    middle = middle[1:-1]
    if a == "A" and b == "B" and middle:
        add_sep = False
        entry = special(middle[0])
        if entry and entry in (sep, eos) and not last:
            add_sep = True
        if len(middle) == 2 and (entry2 := special(middle[1])) and entry2 in (sep, eos):
            add_sep = True
        st.add["sep"] = add_sep
        if add_sep and not sep and cfg:
            cfg["sep_token"] = eos


def read_special_tokens(tok_dir: Path, *, n_vocab: int | None = None, load_merges: bool = True) -> SpecialTokens:
    """Everything gguf-py's ``SpecialVocab(tok_dir, load_merges=..., n_vocab=...)`` would add to a GGUF."""
    st = SpecialTokens()
    types = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"]
    tokenizer: dict[str, Any] | None = None
    added: list[dict[str, Any]] = []
    if (tok_dir / "tokenizer.json").is_file():
        tokenizer = read_json(tok_dir / "tokenizer.json")
        st.merges = _merges(tokenizer) if load_merges else ()
        if norm := tokenizer.get("normalizer"):
            _normalizer_flags(st, norm)
        added = tokenizer.get("added_tokens", [])
    cfg: dict[str, Any] | None = None
    if (tok_dir / "tokenizer_config.json").is_file():
        cfg = dict(read_json(tok_dir / "tokenizer_config.json"))  # _template_flags edits it, as gguf-py does

    def set_id(typ: str, tid: Any) -> None:
        if not isinstance(tid, int) or isinstance(tid, bool):
            return
        if tid < 0:
            raise ValueError(f"invalid value for special token type {typ}: {tid}")
        if (n_vocab is None or tid < n_vocab) and typ not in st.ids:
            st.ids[typ] = tid

    if tokenizer:
        if cfg is not None:
            if not cfg.get("bos_token") and cfg.get("cls_token"):
                cfg["bos_token"] = cfg["cls_token"]
            if not cfg.get("eos_token") and cfg.get("sep_token"):
                cfg["eos_token"] = cfg["sep_token"]
        if post := tokenizer.get("post_processor"):
            for proc in post.get("processors", [post]):
                kind = proc.get("type")
                if kind == "ByteLevel":
                    st.add.setdefault("bos", False)
                    st.add.setdefault("eos", False)
                elif kind == "RobertaProcessing":
                    st.add.update(bos=True, eos=True, sep=True)
                    if cfg and not cfg.get("cls_token"):
                        cfg["cls_token"] = proc.get("cls", [cfg.get("bos_token")])[0]
                    if cfg and not cfg.get("sep_token"):
                        cfg["sep_token"] = proc.get("sep", [cfg.get("eos_token")])[0]
                elif kind == "TemplateProcessing":
                    _template_flags(st, proc, cfg, types)
    if cfg:
        st.chat_template = _chat_template(tok_dir, cfg)
        for typ in types:
            flag = cfg.get(f"add_{typ}_token")
            if isinstance(flag, bool):
                st.add.setdefault(typ, flag)
            entry = cfg.get(f"{typ}_token")
            content = entry.get("content") if isinstance(entry, dict) else entry
            if isinstance(content, str):
                set_id(typ, next((t.get("id") for t in added if t.get("content") == content), None))
    if (tok_dir / "config.json").is_file():
        config = read_json(tok_dir / "config.json")
        for typ in types:
            tid = config.get(f"{typ}_token_id")
            if tid is None and "text_config" in config:
                tid = config["text_config"].get(f"{typ}_token_id")
            set_id(typ, tid)
    return st


def source_files(tok_dir: Path) -> list[Path]:
    """Every file of ``tok_dir`` that :func:`read_special_tokens` may read (present or not), and with it the
    vocabulary builders, which read tokenizer.json and these configs only: what a built vocabulary depends on."""
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
             "chat_template.jinja", "chat_template.json")
    return [tok_dir / n for n in names] + sorted((tok_dir / "additional_chat_templates").glob("*.jinja"))


def _chat_template(tok_dir: Path, cfg: dict[str, Any]) -> str | list[dict[str, str]] | None:
    alt: str | list[dict[str, str]] | None = None
    jinja, js = tok_dir / "chat_template.jinja", tok_dir / "chat_template.json"
    if jinja.is_file():
        alt = jinja.read_text(encoding="utf-8")
        extra = sorted((tok_dir / "additional_chat_templates").glob("*.jinja"))
        if extra:
            alt = [{"name": "default", "template": alt}] + [
                {"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in extra]
    elif js.is_file():
        alt = read_json(js).get("chat_template")
    template = cfg.get("chat_template", alt)
    if template is None or isinstance(template, (str, list)):
        return template
    log.warning("ignoring chat_template of unexpected type in %s", tok_dir / "tokenizer_config.json")
    return None
