"""What the tuner asks the server: a small prompt set rendered through the target's own chat template.

The built-in set covers the kinds of text acceptance depends on: code (a multi-turn JavaScript task like
the one in the field report that first showed n-max 15 losing to 4), chat, Japanese prose, and one
long-context prompt. A user's prompt file replaces it. Prompts are rendered once by the server's
``/apply-template`` (the target's template, the server's defaults), with the thinking switch set as
the user will serve; every configuration then gets the same token sequence.

When the target is served with its projector (``--mmproj``), one image prompt joins the set: a picture the tool
draws itself (or the user's ``--image``), rendered through the same chat template as an ``image_url`` part, and sent
to ``/completion`` in llama-server's multimodal form (``{"prompt_string": ..., "multimodal_data": [base64]}``), the
media marker standing where the image goes. The drafter sees the prompt's text tokens only, so its acceptance on an
image prompt can differ from the text prompts': the report keeps them apart.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import InputError, TuneError

Message = dict[str, str]


# The text llama-server puts where a medium goes and replaces by its embeddings (mtmd_default_marker; b11434's server
# draws a random one per process unless $LLAMA_MEDIA_MARKER is set, and reports it in /props "media_marker").
MEDIA_MARKER = "<__media__>"
IMAGE_PROMPT = "image"  # the image prompt's name in the workload and the report
PromptKind = str  # "text" | "image": what a prompt carries, as the report groups them


@dataclass(frozen=True)
class Prompt:
    """One request: chat ``messages`` (rendered by the template) or a raw ``text`` sent as is; with ``image``, the
    picture goes with the last user turn (served only with a projector)."""

    name: str
    messages: tuple[Message, ...] = ()
    text: str | None = None
    sections: int = 0  # > 0: a built-in long-context prompt of this many sections, shortened to fit the context
    image: bytes | None = None

    @property
    def kind(self) -> PromptKind:
        return "image" if self.image is not None else "text"


def generated_image(side: int = 64) -> bytes:
    """A square RGB PNG of colour gradients and a checker pattern, written with zlib and struct: every image
    preprocessor of llama.cpp's mtmd reads it, and square keeps the smallest models' position tables enough."""
    rows = b"".join(b"\x00" + bytes(c for x in range(side) for c in (
        x * 255 // (side - 1), y * 255 // (side - 1), 255 * ((x // 8 + y // 8) % 2))) for y in range(side))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


_IMAGE_QUESTION = ("Describe this picture: its colours, the shapes in it and how they are arranged, then say what it "
                   "could be used for.")


def image_prompt(image: bytes) -> Prompt:
    """The workload's image request: one user turn asking about ``image``."""
    return Prompt(IMAGE_PROMPT, ({"role": "user", "content": _IMAGE_QUESTION},), image=image)


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


def load_image(path: Path) -> bytes:
    """The bytes of ``--image FILE`` (llama.cpp's mtmd decodes it: PNG, JPEG, BMP, GIF...).

    Raises:
        InputError: it cannot be read or is empty.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputError(f"Cannot read the image {path} ({e.strerror or e}).") from None
    if not data:
        raise InputError(f"The image {path} is empty. Pass a PNG or JPEG file.")
    return data


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


# llama-server flags that set a sampling default: every request sets its own (Sampling.body), so they would do nothing
SAMPLING_SERVER_FLAGS = ("--temp", "--temperature", "--top-k", "--top-p", "--min-p", "--seed", "-s")
_GGUF_SAMPLING = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
                  "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p"}


@dataclass(frozen=True)
class Sampling:
    """How every request samples: greedy (temperature 0, top-k 1) unless a temperature is given, as a chat front end
    serves; seeded, so a configuration's text can be held to the target alone's under the same seed. A filter left
    unset is llama-server's default (top-k 40, top-p 0.95, min-p 0.05 in b11434's common.h)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int = 0
    source: str = "greedy"  # where the settings come from: greedy, given, or the target's general.sampling.* keys

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def of_model(cls, meta: Any, **given: Any) -> Sampling:
        """The target GGUF's ``general.sampling.*`` keys (its generation_config.json, as the converter writes it),
        ``given`` values over them (None: not given).

        Raises:
            InputError: the GGUF records no temperature.
        """
        found = {field: meta.get(key) for field, key in _GGUF_SAMPLING.items() if meta.get(key) is not None}
        if "temperature" not in found and given.get("temperature") is None:
            raise InputError("--sampling model: the target GGUF has no general.sampling.temp key (its checkpoint's "
                             "generation_config.json gives no temperature). Give --temperature T (and --top-p, "
                             "--top-k, --min-p) instead.")
        return cls(**{**found, **{k: v for k, v in given.items() if v is not None}},
                   source="the target's generation_config.json (general.sampling.* in its GGUF)")

    def body(self) -> dict[str, Any]:
        """The request fields."""
        if self.greedy:
            return {"temperature": 0.0, "top_k": 1, "seed": self.seed}
        filters = {"top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}
        return {"temperature": self.temperature, "seed": self.seed, **{k: v for k, v in filters.items()
                                                                         if v is not None}}

    @property
    def text(self) -> str:
        """"greedy (temperature 0, top_k 1)" or "temperature 0.8, top_p 0.95, seed 0 (given)"."""
        if self.greedy:
            return "greedy (temperature 0, top_k 1)"
        parts = [f"{k} {v:g}" for k, v in (("temperature", self.temperature), ("top_k", self.top_k),
                                           ("top_p", self.top_p), ("min_p", self.min_p)) if v is not None]
        unset = [k for k in ("top_k", "top_p", "min_p") if getattr(self, k) is None]
        return (", ".join(parts) + f", seed {self.seed} ({self.source})"
                + (f"; {', '.join(unset)} llama-server's default" if unset else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"greedy": self.greedy, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "min_p": self.min_p, "seed": self.seed, "source": self.source}


@dataclass(frozen=True)
class Workload:
    """The prompts and how each is generated: greedy unless sampling is given, a fixed token count, one discarded
    warm-up."""

    prompts: tuple[Prompt, ...] = BUILTIN_PROMPTS
    n_predict: int = 128
    repeats: int = 3
    thinking: str = "auto"  # "auto" (as the server would serve, given the user's flags) | "on" | "off"
    source: str = "built-in"
    image: bytes | None = None  # the user's --image; None: the tool draws one (used only with a projector)
    image_source: str = "generated"
    sampling: Sampling = field(default_factory=Sampling)

    def with_image_prompt(self) -> Workload:
        """This workload with the image prompt added (once): for a target served with its projector."""
        if any(p.image is not None for p in self.prompts):
            return self
        picture = self.image if self.image is not None else generated_image()
        return replace(self, prompts=(*self.prompts, image_prompt(picture)))

    @property
    def image_prompts(self) -> tuple[Prompt, ...]:
        return tuple(p for p in self.prompts if p.image is not None)

    def request(self, prompt: str, n_predict: int | None = None, media: tuple[str, ...] = ()) -> dict[str, Any]:
        """The /completion body: the sampling (greedy by default), exactly ``n_predict`` tokens, the prompt evaluated
        every time, and the generated token ids returned (the text check compares them with the target alone's).
        With ``media`` (base64), llama-server's multimodal prompt object: the text holds one media marker per item."""
        body: Any = {"prompt_string": prompt, "multimodal_data": list(media)} if media else prompt
        return {"prompt": body, "n_predict": n_predict or self.n_predict, **self.sampling.body(),
                "ignore_eos": True, "cache_prompt": False, "stream": False, "return_tokens": True}

    def to_dict(self) -> dict[str, Any]:
        images = self.image_prompts
        return {"prompts": [p.name for p in self.prompts], "source": self.source, "n_predict": self.n_predict,
                "repeats": self.repeats, "warmup": 1, "sampling": f"{self.sampling.text}, ignore_eos",
                "sampling_settings": self.sampling.to_dict(),
                "thinking_requested": self.thinking,
                "image": {"prompts": [p.name for p in images], "source": self.image_source,
                          "bytes": len(images[0].image or b"")} if images else None}


@dataclass(frozen=True)
class Rendered:
    """The workload's prompts as text the target will see, and what the thinking switch was set to. An image
    prompt's text holds ``MEDIA_MARKER`` where the image goes (``request`` puts the server's own marker there)."""

    texts: tuple[tuple[str, str], ...]  # (name, prompt text)
    thinking: str  # "on" | "off" | "no switch in the template" | "raw prompts"
    media: tuple[tuple[str, str], ...] = ()  # (name, base64 image) of each image prompt

    def kind(self, name: str) -> PromptKind:
        return "image" if any(n == name for n, _ in self.media) else "text"

    def request(self, workload: Workload, name: str, text: str, marker: str = MEDIA_MARKER,
                n_predict: int | None = None) -> dict[str, Any]:
        """The /completion body of one rendered prompt, for a server whose media marker is ``marker``."""
        media = tuple(data for n, data in self.media if n == name)
        if media:
            text = text.replace(MEDIA_MARKER, marker)
        return workload.request(text, n_predict, media)


def _with_image(messages: tuple[Message, ...], image: bytes) -> list[dict[str, Any]]:
    """The turns with the image before the text of the last user turn, as an OpenAI ``image_url`` part."""
    out: list[dict[str, Any]] = [dict(m) for m in messages]
    last = max(i for i, m in enumerate(out) if m["role"] == "user")
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    out[last]["content"] = [{"type": "image_url", "image_url": {"url": url}},
                            {"type": "text", "text": messages[last]["content"]}]
    return out


def render(post: Any, workload: Workload, n_ctx: int | None = None, marker: str = MEDIA_MARKER) -> Rendered:
    """Render the chat prompts once through the server's ``/apply-template``, each fitted to the context.

    ``post(path, body)`` is the server's JSON POST. With ``thinking="auto"`` the server's own default (which
    the user's ``--reasoning`` / ``--chat-template-kwargs`` flags set) is kept, and which way it went is found
    by rendering the first prompt both ways and comparing. The built-in long-context prompt is shortened to
    half the context (a small vocabulary needs many more tokens for the same text). An image prompt is rendered
    with its image as an ``image_url`` part (the server must have the projector loaded); the server's media
    ``marker`` in the result becomes ``MEDIA_MARKER``.

    Raises:
        TuneError: a prompt plus ``n_predict`` tokens does not fit in ``n_ctx``, or the template dropped the image.
    """
    chat = [p for p in workload.prompts if p.text is None]
    kwargs: dict[str, Any] | None = None
    state = "raw prompts"

    def apply(messages: tuple[Message, ...], kw: dict[str, Any] | None, image: bytes | None = None) -> str:
        body: dict[str, Any] = {"messages": list(messages) if image is None else _with_image(messages, image)}
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

    texts, media = [], []
    for p in workload.prompts:
        text = p.text if p.text is not None else apply(p.messages, kwargs, p.image)
        if p.image is not None:
            if text.count(marker) != 1:
                raise TuneError(f"The chat template rendered the image prompt {p.name!r} without the server's media "
                                f"marker {marker!r}: llama-server could not place the image. Pass --no-mmproj to "
                                "measure text prompts only.")
            text = text.replace(marker, MEDIA_MARKER)
            media.append((p.name, base64.b64encode(p.image).decode()))
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
    return Rendered(tuple(texts), state, tuple(media))
