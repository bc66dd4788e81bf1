"""Regenerate ``dflash_gguf/convert/pre_tokenizers.py`` from a llama.cpp checkout's ``conversion/base.py``.

b11434's ``TextModel.get_vocab_base_pre`` is a generated chain of ``if chkhsh == "...": res = "..."``; each
``if`` overwrites ``res``, so when a fingerprint appears twice the later name wins. Usage:
``python scripts/pre_tokenizer_table.py LLAMA_CPP_DIR > dflash_gguf/convert/pre_tokenizers.py``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_ENTRY = re.compile(r'if chkhsh == "([0-9a-f]{64})":\s*\n(?:\s*#[^\n]*\n)*\s*res = "([^"]+)"')


def parse_table(base_py: str) -> dict[str, str]:
    """fingerprint -> ``tokenizer.ggml.pre`` name, as the chain of ifs resolves it (last one wins)."""
    start = base_py.index("def get_vocab_base_pre")
    end = base_py.index("Marker: End get_vocab_base_pre", start)
    table: dict[str, str] = {}
    for chkhsh, name in _ENTRY.findall(base_py[start:end]):
        table[chkhsh] = name
    return table


def render(table: dict[str, str], build: str) -> str:
    lines = [f'"""BPE pre-tokenizer fingerprints -> ``tokenizer.ggml.pre``, as llama.cpp {build}\'s generated',
             "``TextModel.get_vocab_base_pre`` resolves them (data; regenerate with scripts/pre_tokenizer_table.py).",
             '"""', "", "PRE_TOKENIZERS: dict[str, str] = {"]
    lines += [f'    "{h}": "{n}",' for h, n in table.items()]
    lines += ["}", ""]
    return "\n".join(lines)


def main() -> None:
    root = Path(sys.argv[1])
    sys.stdout.write(render(parse_table((root / "conversion" / "base.py").read_text(encoding="utf-8")), "b11434"))


if __name__ == "__main__":
    main()
