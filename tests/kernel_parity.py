"""What the kernel tests share when they hold a built-in kernel to b11434's libggml-base: the input as each source
type stores it, every 16-bit bit pattern, and one failure message naming the first block that differs."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

F = np.float32


def stored(x: np.ndarray, stype: Q) -> tuple[np.ndarray, np.ndarray]:
    """``x`` stored as ``stype`` (what the kernels get) and those values widened to float32 (what ggml gets)."""
    with np.errstate(all="ignore"):
        if stype == Q.F32:
            return x, x
        if stype == Q.F16:
            h = x.astype(np.float16)
            return h, h.astype(F)
    words = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return words, (words.astype(np.uint32) << np.uint32(16)).view(F)


def every_16_bit_value(stype: Q, seed: int = 43) -> tuple[np.ndarray, np.ndarray]:
    """Every F16 or BF16 bit pattern (NaN payloads and inf included), in order and then shuffled, as the kernels
    get them and widened to float32: each as an element, a block extreme and a block scale."""
    rng = np.random.default_rng(seed)
    words = np.arange(1 << 16, dtype=np.uint16)
    words = np.concatenate([words, words[rng.permutation(words.size)]])
    with np.errstate(all="ignore"):
        if stype == Q.F16:
            return words.view(np.float16), words.view(np.float16).astype(F)
        return words, (words.astype(np.uint32) << np.uint32(16)).view(F)


def assert_same_blocks(ours: np.ndarray, ref: np.ndarray, x: np.ndarray, what: str) -> None:
    """Our blocks equal ggml's (``ref``: n x block bytes); else fail naming the first block, its differing bytes and
    the head of its input."""
    ours = ours.reshape(ref.shape)
    bad = np.flatnonzero((ours != ref).any(axis=1))
    if bad.size:
        i = int(bad[0])
        cols = np.flatnonzero(ours[i] != ref[i])
        n = x.size // len(ref)
        pytest.fail(f"{what}: {bad.size}/{len(ref)} blocks differ; first #{i} at bytes {cols[:12].tolist()} "
                    f"(ours {ours[i, cols[:12]].tolist()}, ggml {ref[i, cols[:12]].tolist()}); "
                    f"input head {x.reshape(-1, n)[i, :8].tolist()}")
