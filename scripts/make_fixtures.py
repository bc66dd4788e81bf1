#!/usr/bin/env python3
"""Write the offline fixture repos (tiny Gemma-4/Gemma-3/Qwen3 targets and DFlash drafters) to OUTDIR.

A thin command over the ``tests/fixtures`` package, which the test suite imports directly.
Usage: ``python scripts/make_fixtures.py OUTDIR [--llama-cpp-src DIR] [--variants] [--no-qwen-weights]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/ is not an installed package

from fixtures import make_all  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--llama-cpp-src", type=Path, default=None,
                    help="extracted llama.cpp source (for models/ggml-vocab-qwen2.gguf); enables Qwen fixtures")
    ap.add_argument("--variants", action="store_true", help="also write every drafter variant preset")
    ap.add_argument("--no-qwen-weights", action="store_true", help="skip the ~40 MB Qwen3 target weights")
    args = ap.parse_args(argv)
    made = make_all(args.outdir, llama_cpp_src=args.llama_cpp_src, variants=args.variants,
                    qwen_weights=not args.no_qwen_weights)
    for path in made.values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
