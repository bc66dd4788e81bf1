"""Where a server's memory went: the target's and the drafter's model, KV cache and compute buffers, from the lines
llama.cpp logs for every buffer it allocates (llama_model::load_tensors, llama_kv_cache, llama_memory_recurrent,
llama_context), on the host and on each device alike.

llama-server b11434 loads the target and makes its context first (``common_init_from_params``), then the draft model
and the drafter's own context (``common_speculative_init_from_params``; the target's own MTP head makes a context of
its own without a second model), then the projector (``mtmd_init_from_file``, logged by ``clip_*``). So a buffer is
the drafter's once a model is loaded after the first context, or a second context is constructed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_CONTEXT_LINE = "constructing llama_context"
_BUFFER = re.compile(r"\b(?P<func>\w+):\s+(?P<device>\S+)\s+(?:(?P<kind>[\w ]+?)\s+)?buffer size =\s+"
                     r"(?P<mib>[\d.]+) MiB")
OWNERS = ("target", "drafter", "projector")


def _kind(label: str | None) -> str:
    """``model``, ``kv`` (a KV cache or a recurrent state), ``compute`` or ``other`` (output, LoRA...)."""
    text = (label or "").strip().lower()
    if text == "model":
        return "model"
    if text.endswith(("kv", "rs", "state")):
        return "kv"
    return "compute" if text == "compute" else "other"


@dataclass(frozen=True)
class Buffer:
    """One buffer llama.cpp logged: whose, what for, where, how large."""

    owner: str  # one of OWNERS
    kind: str  # model, kv, compute, other
    device: str  # the ggml buffer's name: CPU, CPU_Mapped, CUDA0, ...
    mib: float


def buffers_from_log(log: str) -> tuple[Buffer, ...]:
    """Every buffer a llama-server log (verbosity 4) names, with its owner."""
    out = []
    contexts = 0
    drafter = False
    for line in log.splitlines():
        if _CONTEXT_LINE in line:
            contexts += 1
            drafter = drafter or contexts > 1
            continue
        m = _BUFFER.search(line)
        if m is None:
            continue
        kind = _kind(m.group("kind"))
        if kind == "model" and contexts:  # a model loaded after the target's context: the draft model
            drafter = True
        owner = "projector" if m.group("func").startswith(("clip", "mtmd")) else "drafter" if drafter else "target"
        out.append(Buffer(owner, kind, m.group("device"), float(m.group("mib"))))
    return tuple(out)


@dataclass(frozen=True)
class MemorySplit:
    """A server's buffers by owner and kind."""

    buffers: tuple[Buffer, ...] = ()

    @classmethod
    def from_log(cls, log: str) -> MemorySplit:
        return cls(buffers_from_log(log))

    def mib(self, owners: Iterable[str] = OWNERS, kinds: Iterable[str] = ("model", "kv", "compute", "other")
            ) -> float:
        owners, kinds = set(owners), set(kinds)
        return sum(b.mib for b in self.buffers if b.owner in owners and b.kind in kinds)

    def to_dict(self) -> dict[str, Any]:
        """MiB per owner present: model, kv, compute, other and their total."""
        out: dict[str, Any] = {}
        for owner in OWNERS:
            if any(b.owner == owner for b in self.buffers):
                parts = {k: round(self.mib([owner], [k]), 2) for k in ("model", "kv", "compute", "other")}
                out[owner] = parts | {"total": round(sum(parts.values()), 2)}
        return out

    @property
    def text(self) -> str:
        """"target 512+64 KV+300, drafter 48+128 KV+90 MiB" (model + KV + compute and other); "" without lines."""
        parts = []
        for owner, d in self.to_dict().items():
            parts.append(f"{owner} {d['model']:.0f}+{d['kv']:.0f} KV+{d['compute'] + d['other']:.0f}")
        return ", ".join(parts) + " MiB" if parts else ""


# bytes per cached value of llama.cpp's KV cache types (-ctk / -ctv): a block's size over its values
_CACHE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                "iq4_nl": 18 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32}


def _first_int(value: Any) -> int | None:
    """An int, or the largest of a per-layer array (the upper bound), or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, list | tuple) and value and all(isinstance(v, int) for v in value):
        return max(value)
    return None


def kv_cache_mib(meta: Any, n_ctx: int, k_type: str = "f16", v_type: str = "f16") -> float:
    """An upper bound on a model's KV cache at ``n_ctx`` cells, from its GGUF header: every layer caching the full
    context (sliding-window and recurrent layers cache less), K and V at the cache types given. 0 when the header
    does not say (not an attention model llama.cpp knows)."""
    arch = meta.get("general.architecture")
    layers = _first_int(meta.get(f"{arch}.block_count"))
    heads = _first_int(meta.get(f"{arch}.attention.head_count"))
    heads_kv = _first_int(meta.get(f"{arch}.attention.head_count_kv")) or heads
    width = _first_int(meta.get(f"{arch}.embedding_length"))
    if not (layers and heads_kv and (heads or meta.get(f"{arch}.attention.key_length"))):
        return 0.0
    head = width // heads if width and heads else 0
    k = _first_int(meta.get(f"{arch}.attention.key_length")) or head
    v = _first_int(meta.get(f"{arch}.attention.value_length")) or head
    per_token = heads_kv * (k * _CACHE_BYTES.get(k_type, 2.0) + v * _CACHE_BYTES.get(v_type, 2.0))
    return layers * n_ctx * per_token / 2**20


def parse_size(text: str) -> int:
    """``24G``, ``512M``, ``1.5G``, ``4096`` (bytes) as bytes; K, M, G, T are powers of 1024.

    Raises:
        ValueError: not a size.
    """
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)i?B?\s*", text, re.I)
    if m is None:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with K, M, G or T (e.g. 12G).")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))
