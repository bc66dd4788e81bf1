"""A Hugging Face model card (``README.md``): its YAML front matter, read one way by the converters (which record
the drafter's base model) and by verify's lineage checks (which compare it with the target).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CARD = "README.md"
MAX_CARD_BYTES = 4 << 20  # real cards are kilobytes; a larger one is not read


def front_matter(card_text: str | None) -> dict[str, Any]:
    """The YAML header of a model card, or {} when there is none or it does not parse."""
    if not card_text or not card_text.startswith("---"):
        return {}
    end = card_text.find("\n---", 3)
    try:
        data = yaml.safe_load(card_text[3:end if end > 0 else len(card_text)])
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def str_list(value: Any) -> list[str]:
    """A front-matter field that may be one string or a list, as strings."""
    if isinstance(value, str):
        return [value] if value.strip() else []
    return [str(v) for v in value if isinstance(v, str | int | float)] if isinstance(value, list) else []


def read_card(folder: Path) -> str | None:
    """``folder/README.md`` as text, or None when it is missing, too large or not UTF-8."""
    path = Path(folder) / CARD
    try:
        if path.stat().st_size > MAX_CARD_BYTES:
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def base_models(folder: Path) -> list[str]:
    """The card's ``base_model`` entries (the model it was trained from or for)."""
    return str_list(front_matter(read_card(folder)).get("base_model"))
