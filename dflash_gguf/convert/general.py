"""The ``general.*`` keys every converted model starts with, in b11434's order.

b11434 (``ModelBase.prepare_metadata`` -> ``Metadata.set_gguf_meta_model``) writes ``general.type``,
then the sampling defaults from ``generation_config.json`` (llama.cpp uses them as the default
sampler settings), then ``general.name`` and the model-card naming keys. We write the first three;
the naming keys are deliberately left out (README, "Keys that differ by design").
"""

from __future__ import annotations

import json
from pathlib import Path

from gguf import GGUFValueType

from ..ggufio import GGUFPlan
from ..jsonfile import read_json

# generation_config.json field(s) -> general.sampling.* key and value type (gguf-py Metadata.load,
# GGUFWriter.add_sampling_*), in the order b11434 writes them.
_SAMPLING: tuple[tuple[tuple[str, ...], str, GGUFValueType], ...] = (
    (("sequence",), "sequence", GGUFValueType.STRING),
    (("top_k",), "top_k", GGUFValueType.INT32),
    (("top_p",), "top_p", GGUFValueType.FLOAT32),
    (("min_p",), "min_p", GGUFValueType.FLOAT32),
    (("xtc_probability",), "xtc_probability", GGUFValueType.FLOAT32),
    (("xtc_threshold",), "xtc_threshold", GGUFValueType.FLOAT32),
    (("temperature",), "temp", GGUFValueType.FLOAT32),
    (("penalty_last_n",), "penalty_last_n", GGUFValueType.INT32),
    (("penalty_repeat", "repetition_penalty"), "penalty_repeat", GGUFValueType.FLOAT32),
    (("mirostat",), "mirostat", GGUFValueType.INT32),
    (("mirostat_tau",), "mirostat_tau", GGUFValueType.FLOAT32),
    (("mirostat_eta",), "mirostat_eta", GGUFValueType.FLOAT32),
)


def sampling_defaults(model_dir: Path) -> dict[str, tuple[GGUFValueType, int | float | str]]:
    """``general.sampling.*`` key -> (type, value) from ``model_dir/generation_config.json`` (none if unreadable)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        gen = read_json(path) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        gen = {}  # b11434 ignores an unreadable generation_config.json too
    out: dict[str, tuple[GGUFValueType, int | float | str]] = {}
    for fields, key, vtype in _SAMPLING:
        value = next((gen[f] for f in fields if f in gen), None)
        if value is not None:
            out[f"general.sampling.{key}"] = (vtype, value)
    return out


def add_general(plan: GGUFPlan, name: str, model_dir: Path) -> None:
    """``general.type``, the sampling defaults, ``general.name``."""
    plan.add_string("general.type", "model")
    for key, (vtype, value) in sampling_defaults(model_dir).items():
        if vtype == GGUFValueType.STRING:
            plan.add_string(key, str(value))
        else:
            plan.add(key, vtype, int(value) if vtype == GGUFValueType.INT32 else float(value))
    plan.add_string("general.name", name)
