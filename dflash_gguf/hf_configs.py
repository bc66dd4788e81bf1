"""Hugging Face ``config.json`` and ``tokenizer.json`` files: read with one clear error each, and configs
normalised as transformers reads them.

b11434 loads configs through ``transformers.AutoConfig``; we never import transformers, so the defaults and
rewrites it applies to the families we read (Qwen3 and Qwen3-MoE targets, and the DFlash drafters that declare
``model_type: qwen3``) are reproduced here, in one place, for the converters and the drafter rules alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeGuard

from .errors import ConfigError, TokenizerError
from .jsonfile import read_json


def read_config(path: Path, what: str) -> dict[str, Any]:
    """A config.json (or the one in folder ``path``) as a dict; one message for every way it can be unreadable.

    Raises:
        ConfigError: missing, unreadable, not JSON, or not an object (names the file and what to do).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{what}: {path} does not exist. Point at the folder of a Hugging Face checkpoint "
                          "(it must contain config.json).")
    try:
        data = read_json(path)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{what}: {path} is not valid JSON ({getattr(e, 'reason', e)}). Re-download it.") from None
    except OSError as e:
        raise ConfigError(f"{what}: {path} cannot be read ({e.strerror or e}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} is not a JSON object. Re-download it.")
    check_hyperparameters(data, path, what)
    return data


# Fields every converter and interpreter reads as sizes or counts, and the norm epsilons: checked wherever a config
# is read, so a hostile or damaged value is refused with its name before it is used or written into a GGUF.
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "head_dim", "vocab_size", "max_position_embeddings", "block_size", "num_target_layers",
               "moe_intermediate_size", "num_experts", "num_experts_per_tok", "sliding_window")
EPSILON_FIELDS = ("rms_norm_eps", "norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    """A nested config object (``text_config``, ``dflash_config``...), or an empty one when absent or not an object."""
    value = raw.get(key)
    return value if isinstance(value, dict) else {}


def check_hyperparameters(data: dict[str, Any], path: Path, what: str) -> None:
    """Sizes are whole numbers above 0 (or lists of them), norm epsilons lie in (0, 1), rope_theta is above 0; at
    the top level and in ``text_config``. ``None`` means "not set" and is left to the readers' defaults.

    Raises:
        ConfigError: naming the file, the field and its value.
    """
    for prefix, section in (("", data), ("text_config.", data.get("text_config"))):
        if not isinstance(section, dict):
            continue
        for name in SIZE_FIELDS:
            value = section.get(name)
            items = value if isinstance(value, list) else [value]
            if value is not None and not all(_number(v) and v > 0 and float(v).is_integer() for v in items):
                raise ConfigError(f"{what}: {path} field '{prefix}{name}' is {value!r}; it must be a whole number "
                                  "above 0. The config is damaged or not a model's: use the config.json published "
                                  "with the model.")
        for name in (*EPSILON_FIELDS, "rope_theta"):
            value = section.get(name)
            ok = _number(value) and value > 0 and (name == "rope_theta" or value < 1)
            if value is not None and not ok:
                want = "a number above 0" if name == "rope_theta" else "a number between 0 and 1"
                raise ConfigError(f"{what}: {path} field '{prefix}{name}' is {value!r}; it must be {want}. The "
                                  "config is damaged or not a model's: use the config.json published with the model.")


def parse_tokenizer_json(path: Path, *, missing: str) -> dict[str, Any]:
    """A tokenizer.json, every kind of damage turned into one TokenizerError (``missing``: what to say when the
    file is absent, which depends on why it is read).

    Raises:
        TokenizerError: missing, truncated, not JSON, or not a Hugging Face tokenizers file.
    """
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(missing)
    try:
        data = read_json(path)
        if not isinstance(data["model"]["vocab"], (dict, list)):
            raise TypeError("model.vocab is not a table")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise TokenizerError(f"{path} is corrupt, truncated or not a Hugging Face tokenizers file "
                             f"({getattr(e, 'reason', None) or repr(e)}). "
                             "Re-download it (huggingface-cli download REPO tokenizer.json --force-download).") \
            from None
    return data
