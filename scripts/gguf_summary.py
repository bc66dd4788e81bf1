"""Print a short summary of a GGUF file: the DFlash keys llama.cpp reads, vocabulary, tensors by type."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from gguf import GGUFReader, GGUFValueType

SHOWN = ("general.architecture", "general.file_type", "dflash.block_count", "dflash.embedding_length",
         "dflash.target_layers", "dflash.block_size", "dflash.embedding_scale", "dflash.attention.sliding_window",
         "dflash.attention.sliding_window_pattern", "dflash.rope.freq_base", "tokenizer.ggml.model",
         "tokenizer.ggml.mask_token_id", "dflash_gguf.tokenizer.origin", "dflash_gguf.llama_cpp_build")


def main(path: Path) -> None:
    reader = GGUFReader(path)
    print(f"{path} ({path.stat().st_size / 1e6:.2f} MB)")
    for key in SHOWN:
        field = reader.fields.get(key)
        if field is None:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            value = [field.contents(i) for i in range(len(field.data))]
        else:
            value = field.contents()
        print(f"  {key:42} {value}")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    print(f"  {'tokenizer.ggml.tokens':42} {len(tokens.data)} tokens")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    print(f"  {'tensors':42} {len(reader.tensors)} ({', '.join(f'{n} {k}' for k, n in sorted(types.items()))})")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
