"""Mixture-of-experts weights as b11434's ``Qwen2MoeModel.modify_tensors`` (conversion/qwen.py) writes them, for
the families whose b11434 class inherits it (Qwen3-MoE, Qwen3.5-MoE).

Two checkpoint layouts reach that method:

* fused 3-D tensors (transformers 5, the Qwen3.5-MoE releases): ``mlp.experts.gate_up_proj`` ``[E, 2*ff, h]`` is
  split on its middle axis into ``ffn_gate_exps`` and ``ffn_up_exps`` (gate first), ``mlp.experts.down_proj`` is
  written as it is (:func:`split_gate_up`);
* one tensor per expert (the Qwen3-MoE releases): ``mlp.experts.{e}.{gate,up,down}_proj.weight``. b11434 keeps
  a layer's expert tensors aside until it has read all ``3 * E`` of them, then writes
  ``ffn_down_exps``, ``ffn_gate_exps``, ``ffn_up_exps`` (that order), each the experts stacked by index on a new
  first axis. The stacked tensors therefore sit where the layer's *last-read* expert tensor sits in the
  checkpoint's order (``experts.9`` after ``experts.10`` in sorted names): :class:`ExpertStacks`.

Nothing is read here: a stacked tensor is a :class:`~.base.TensorSpec` with ``parts``, which the writer streams
part after part.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError, UnsupportedModelError
from ..safetensors import TensorRef
from .base import TensorSpec, block_id

LLAMA_MAX_EXPERTS = 1024  # src/llama-hparams.h of b11434: the loader asserts n_expert <= this


def check_config_fields(path: Path, hp: Mapping[str, Any], keys: tuple[str, ...], model: str) -> None:
    """Every field in ``keys`` is set: a null one (which the transformers config class keeps) leaves b11434's
    converter nothing to write and nothing to size the model by.

    Raises:
        ConfigError: the first null or missing field.
    """
    for key in keys:
        if hp.get(key) is None:
            raise ConfigError(f"{path}: field '{key}' is missing or null; a {model} model needs it. Use the "
                              "config.json published with the model.")


def check_expert_counts(path: Path, n_exp: int, n_used: int, exp_key: str) -> None:
    """The expert counts b11434's loader accepts: at most ``LLAMA_MAX_EXPERTS``, no more used than exist.

    Raises:
        ConfigError: ``num_experts_per_tok`` above the expert count.
        UnsupportedModelError: more experts than b11434 loads.
    """
    if n_used > n_exp:
        raise ConfigError(f"{path}: num_experts_per_tok ({n_used}) is above {exp_key} ({n_exp}); llama.cpp "
                          "b11434's loader asserts n_expert_used <= n_expert. Use the config.json published with "
                          "the model.")
    if n_exp > LLAMA_MAX_EXPERTS:
        raise UnsupportedModelError(f"{path}: {exp_key} is {n_exp}; llama.cpp b11434 loads at most "
                                    f"{LLAMA_MAX_EXPERTS} experts (LLAMA_MAX_EXPERTS) and would refuse the file.")


# One expert's projection, after the family's name normalisation.
PER_EXPERT = re.compile(r"^(?P<stem>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<kind>gate|up|down)_proj\.weight$")
STACK_ORDER = ("down", "gate", "up")  # the w_name loop of Qwen2MoeModel.modify_tensors


def split_gate_up(spec: TensorSpec) -> list[TensorSpec]:
    """A fused ``ffn_gate_up_exps`` ``[E, 2*ff, h]`` as b11434 splits it: ``ffn_gate_exps`` (the first ``ff`` rows
    of every expert), then ``ffn_up_exps`` (the last ``ff``); streamed, nothing copied in memory."""
    ref = spec.ref
    assert ref is not None
    n_exp, two_ff, n_embd = ref.shape
    half = n_exp * (two_ff // 2) * n_embd * (ref.nbytes // (n_exp * two_ff * n_embd))
    # A view with one "row" per half expert (gate, up, gate, up, ...); the streamed writer reads
    # row r at offset r * nbytes / rows, so half the bytes and every other row select one half.
    view = replace(ref, shape=(n_exp, two_ff // 2, n_embd), nbytes=half)
    shape: tuple[int, ...] = (n_exp, two_ff // 2, n_embd)
    stem = spec.name.removesuffix("gate_up_exps.weight")
    return [TensorSpec(stem + "gate_exps.weight", shape, ref=view, row_order=np.arange(0, 2 * n_exp, 2)),
            TensorSpec(stem + "up_exps.weight", shape, ref=view, row_order=np.arange(1, 2 * n_exp, 2))]


def expert_part_name(bid: int, kind: str, expert: int) -> str:
    """The planning name of one expert's tensor (it is no GGUF tensor of its own: it becomes one slice of
    ``blk.N.ffn_<kind>_exps.weight``); error messages about a missing or mis-shaped expert show it."""
    return f"blk.{bid}.ffn_{kind}_exps.weight[expert {expert}]"


@dataclass(frozen=True)
class ExpertStacks:
    """A checkpoint's one-tensor-per-expert weights, grouped by layer, with where b11434 writes each stack."""

    n_experts: int
    refs: dict[str, TensorRef]  # normalised HF name -> tensor, per-expert tensors only
    stack_at: dict[str, str]  # HF name of the layer's last-read expert tensor -> the layer's experts stem

    @classmethod
    def index(cls, tensors: dict[str, TensorRef], normalise: Callable[[str], str], n_experts: int,
              skip: Callable[[str], bool] = lambda _: False) -> ExpertStacks:
        """Group ``tensors`` (in b11434's reading order) by layer; the last one read of each layer is remembered."""
        refs: dict[str, TensorRef] = {}
        last: dict[str, str] = {}
        for hf_name, ref in tensors.items():
            if skip(hf_name):
                continue
            name = normalise(hf_name)
            if (m := PER_EXPERT.match(name)) is not None:
                refs[name] = ref
                last[m["stem"]] = hf_name
        return cls(n_experts, refs, {hf_name: stem for stem, hf_name in last.items()})

    def __bool__(self) -> bool:
        return bool(self.refs)

    def planning_name(self, name: str) -> str | None:
        """:func:`expert_part_name` of a normalised per-expert HF name; None for any other tensor."""
        m = PER_EXPERT.match(name)
        bid = block_id(name)
        return expert_part_name(bid, m["kind"], int(m["expert"])) if m is not None and bid is not None else None

    def stacked(self, hf_name: str, gguf_prefix: str) -> list[TensorSpec]:
        """What b11434 writes on reading ``hf_name``: the layer's three stacked tensors if it is the layer's last
        expert tensor, else nothing yet. A layer with an expert missing gives nothing (b11434 stops with
        'Unprocessed experts'; the caller's missing-tensor check names the expert)."""
        stem = self.stack_at.get(hf_name)
        if stem is None:
            return []
        out = []
        for kind in STACK_ORDER:
            names = [f"{stem}.{e}.{kind}_proj.weight" for e in range(self.n_experts)]
            if any(n not in self.refs for n in names):
                return []
            parts = tuple(self.refs[n] for n in names)
            out.append(TensorSpec(f"{gguf_prefix}ffn_{kind}_exps.weight", (self.n_experts, *parts[0].shape),
                                  ref=parts[0], parts=parts))
        return out


def expert_shapes(bid: int, n_experts: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The expected shape of every expert's own tensor in layer ``bid``, by planning name (``shapes``: kind ->
    one expert's HF shape)."""
    return {expert_part_name(bid, kind, e): shape for kind, shape in shapes.items() for e in range(n_experts)}
