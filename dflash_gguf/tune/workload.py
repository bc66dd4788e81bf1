"""What the tuner asks the server: a small prompt set rendered through the target's own chat template.

The built-in set covers the kinds of text acceptance depends on: code (a multi-turn JavaScript task like
the one in the field report that first showed n-max 15 losing to 4), chat, Japanese prose, and one
long-context prompt. A user's prompt file replaces it. Prompts are rendered once by the server's
``/apply-template`` (the target's template, the server's defaults), with the thinking switch set as
the user will serve; every configuration then gets the same token sequence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError, TuneError

Message = dict[str, str]


@dataclass(frozen=True)
class Prompt:
    """One request: chat ``messages`` (rendered by the template) or a raw ``text`` sent as is."""

    name: str
    messages: tuple[Message, ...] = ()
    text: str | None = None
    sections: int = 0  # > 0: a built-in long-context prompt of this many sections, shortened to fit the context


_JS_TURNS: tuple[Message, ...] = (
    {"role": "user", "content": "Write a JavaScript function debounce(fn, ms) that delays calling fn until ms "
                                "milliseconds have passed since the last call."},
    {"role": "assistant", "content": "function debounce(fn, ms) {\n  let timer;\n  return function (...args) {\n"
                                     "    clearTimeout(timer);\n    timer = setTimeout(() => fn.apply(this, args), "
                                     "ms);\n  };\n}"},
    {"role": "user", "content": "Add a cancel() method and a leading-edge option."},
    {"role": "assistant", "content": "function debounce(fn, ms, { leading = false } = {}) {\n  let timer = null;\n"
                                     "  function debounced(...args) {\n    const callNow = leading && !timer;\n"
                                     "    clearTimeout(timer);\n    timer = setTimeout(() => { timer = null; if "
                                     "(!leading) fn.apply(this, args); }, ms);\n    if (callNow) fn.apply(this, "
                                     "args);\n  }\n  debounced.cancel = () => { clearTimeout(timer); timer = null; "
                                     "};\n  return debounced;\n}"},
    {"role": "user", "content": "Now write Jest tests for both options, covering cancel() too."},
)


def _long_context(n: int) -> tuple[Message, ...]:
    """A log-recovery design note of ``n`` sections and a question about all of it."""
    text = "\n\n".join(_SECTION.format(i=i, batch=8 * i, minutes=5 * i) for i in range(1, n + 1))
    return ({"role": "user", "content": text + "\n\nSummarise how this service recovers after a crash, then "
                                               "list three ways it could lose data."},)


_SECTION = (
    "Section {i}. The service keeps a write-ahead log of every change. Each record holds a sequence number, the "
    "table it touches, the primary key, and the new row as JSON. Records are fsynced in batches of {batch} before "
    "the client is told the write succeeded; a checkpoint every {minutes} minutes lets old segments be deleted. On "
    "restart the log is replayed from the last checkpoint, skipping records whose sequence number is already in "
    "the table.")
LONG_CONTEXT_SECTIONS = 24

BUILTIN_PROMPTS: tuple[Prompt, ...] = (
    Prompt("code", _JS_TURNS),
    Prompt("chat", ({"role": "user", "content": "I have three days in Lisbon in March. Suggest a plan that mixes "
                                                "museums, food and a day trip, and say roughly what it costs."},)),
    Prompt("japanese", ({"role": "user", "content": "日本の四季について、それぞれの季節の特徴と代表的な行事を、"
                                                    "やさしい日本語で説明してください。"},)),
    Prompt("long-context", _long_context(LONG_CONTEXT_SECTIONS), sections=LONG_CONTEXT_SECTIONS),
)


def load_prompt_file(path: Path) -> tuple[Prompt, ...]:
    """A JSON list (or JSON Lines) of prompts: a string (one user turn), ``{"messages": [...]}`` (chat turns,
    optional ``"name"``), or ``{"prompt": "..."}`` (raw text, sent without the chat template).

    Raises:
        InputError: unreadable, empty, or an entry of another shape.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(f"Cannot read the prompt file {path} ({e.strerror or e}).") from None
    try:
        entries: Any = json.loads(text)
    except ValueError:
        try:
            entries = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as e:
            raise InputError(f"{path} is neither a JSON list nor JSON Lines ({e}). Write a list of strings or "
                             'of {"messages": [{"role": "user", "content": "..."}]} objects.') from None
    if not isinstance(entries, list) or not entries:
        raise InputError(f"{path} holds no prompts. Write a JSON list of strings or of "
                         '{"messages": [...]} / {"prompt": "..."} objects.')
    return tuple(_prompt(path, i, e) for i, e in enumerate(entries))


def _prompt(path: Path, i: int, entry: Any) -> Prompt:
    name = f"prompt-{i + 1}"
    if isinstance(entry, str) and entry.strip():
        return Prompt(name, ({"role": "user", "content": entry},))
    if isinstance(entry, dict):
        name = str(entry.get("name") or name)
        msgs = entry.get("messages")
        if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                   and isinstance(m.get("content"), str) for m in msgs):
            return Prompt(name, tuple({"role": m["role"], "content": m["content"]} for m in msgs))
        if isinstance(entry.get("prompt"), str) and entry["prompt"].strip():
            return Prompt(name, text=entry["prompt"])
    raise InputError(f"{path}: entry {i + 1} is not a prompt. Each entry is a string, "
                     '{"messages": [{"role": "user", "content": "..."}]} or {"prompt": "raw text"}.')


@dataclass(frozen=True)
class Workload:
    """The prompts and how each is generated: greedy, a fixed token count, one discarded warm-up."""

    prompts: tuple[Prompt, ...] = BUILTIN_PROMPTS
    n_predict: int = 128
    repeats: int = 3
    thinking: str = "auto"  # "auto" (as the server would serve, given the user's flags) | "on" | "off"
    source: str = "built-in"

    def request(self, prompt: str, n_predict: int | None = None) -> dict[str, Any]:
        """The /completion body: greedy and exactly ``n_predict`` tokens, the prompt evaluated every time, and the
        generated token ids returned (the greedy check compares them with the target alone's)."""
        return {"prompt": prompt, "n_predict": n_predict or self.n_predict, "temperature": 0.0, "top_k": 1,
                "seed": 0, "ignore_eos": True, "cache_prompt": False, "stream": False, "return_tokens": True}

    def to_dict(self) -> dict[str, Any]:
        return {"prompts": [p.name for p in self.prompts], "source": self.source, "n_predict": self.n_predict,
                "repeats": self.repeats, "warmup": 1, "sampling": "greedy (temperature 0, top_k 1), ignore_eos",
                "thinking_requested": self.thinking}


@dataclass(frozen=True)
class Rendered:
    """The workload's prompts as text the target will see, and what the thinking switch was set to."""

    texts: tuple[tuple[str, str], ...]  # (name, prompt text)
    thinking: str  # "on" | "off" | "no switch in the template" | "raw prompts"


def render(post: Any, workload: Workload, n_ctx: int | None = None) -> Rendered:
    """Render the chat prompts once through the server's ``/apply-template``, each fitted to the context.

    ``post(path, body)`` is the server's JSON POST. With ``thinking="auto"`` the server's own default (which
    the user's ``--reasoning`` / ``--chat-template-kwargs`` flags set) is kept, and which way it went is found
    by rendering the first prompt both ways and comparing. The built-in long-context prompt is shortened to
    half the context (a small vocabulary needs many more tokens for the same text).

    Raises:
        TuneError: a prompt plus ``n_predict`` tokens does not fit in ``n_ctx``.
    """
    chat = [p for p in workload.prompts if p.text is None]
    kwargs: dict[str, Any] | None = None
    state = "raw prompts"

    def apply(messages: tuple[Message, ...], kw: dict[str, Any] | None) -> str:
        body: dict[str, Any] = {"messages": list(messages)}
        if kw is not None:
            body["chat_template_kwargs"] = kw
        return str(post("/apply-template", body)["prompt"])

    if chat:
        probe = chat[0].messages
        on, off = apply(probe, {"enable_thinking": True}), apply(probe, {"enable_thinking": False})
        if on == off:
            state = "no switch in the template"
        elif workload.thinking in ("on", "off"):
            state, kwargs = workload.thinking, {"enable_thinking": workload.thinking == "on"}
        else:
            default = apply(probe, None)
            state = "on" if default == on else "off" if default == off else "server default"

    def n_tokens(text: str) -> int:
        return len(post("/tokenize", {"content": text, "add_special": True})["tokens"])

    texts = []
    for p in workload.prompts:
        text = p.text if p.text is not None else apply(p.messages, kwargs)
        if n_ctx:
            if p.sections:
                n = p.sections
                while n > 1 and n_tokens(text) > n_ctx // 2:
                    n = max(1, n // 2)
                    text = apply(_long_context(n), kwargs)
            if (used := n_tokens(text)) + workload.n_predict > n_ctx:
                raise TuneError(f"The prompt {p.name!r} is {used} tokens; with {workload.n_predict} generated "
                                f"tokens it does not fit the server's context of {n_ctx}. Pass a larger context "
                                "after -- (for example -- -c 16384) or fewer --n-predict.")
        texts.append((p.name, text))
    return Rendered(tuple(texts), state)
