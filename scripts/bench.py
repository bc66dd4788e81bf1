"""Speed and memory, side by side with llama.cpp b11434, in one run (``make bench``).

1. Convert a synthetic drafter shaped like z-lab/gemma4-12B-it-DFlash (hidden 3840, 5 layers,
   6 taps, intermediate 7680, BF16, ~1.5 GB) with dflash-gguf and with b11434's
   convert_hf_to_gguf.py; check the two outputs agree; print wall time, MB/s, peak RSS, ratios.
2. Quantize that drafter GGUF to Q8_0 and Q4_0 with the built-in quantizer (2 threads) and with
   b11434's llama-quantize.
3. Convert ~3 GB and ~1.5 GB synthetic targets shaped like Gemma-4 and Qwen3 with
   ``dflash-gguf convert-target`` and with b11434's converter; check parity (``--only-targets``: only these).
   Then ~1.4-1.9 GB targets shaped like Qwen3-30B-A3B (BF16 experts), gpt-oss-20b (MXFP4 experts) and
   MiniMax-M2 (FP8 e4m3, 128x128 block scales) the same way (``--only-moe-targets``: only these three).
4. The whole pipeline (``dflash-convert --target --drafter --quant q4_0`` from local folders) against the
   manual workflow (b11434's converter twice, llama-quantize twice): wall time, peak RSS, peak disk
   (``--only-pipeline``: only these).
5. The tuner's own cost: ``dflash-gguf tune`` on the hand-built acceptance fixture (acceptance ~1) against a
   hand loop that starts b11434's llama-server for the same configurations and sends the same number of
   requests (``--only-tune``: only these). Then ``dflash-gguf forecast`` on stand-ins against the real pair
   converted from the same folders, both at b11434's ``--spec-synth-len`` (``--only-forecast``: only these).
6. Quantization kernels, one thread (``--only-kernels``: only these): in process, MB/s of BF16 input for the
   compiled kernels at every instruction set this CPU has, the numpy kernels and b11434's ``quantize_row_*_ref``
   (libggml-base, F32 in, the widening excluded), then with an importance matrix against ``ggml_quantize_chunk``;
   then ``dflash-gguf quantize --threads 1`` against ``llama-quantize ... 1`` on ~0.4 GB BF16 files per type.
7. The Q4_K_M one pass against the disk (``--only-kquant-disk``: only this): a 3.2 GB Qwen3-4B-shaped target,
   ``cat`` of its shards, ``dflash-gguf convert-target --quant Q4_K_M`` and b11434's convert + llama-quantize, each
   from an empty page cache when run as root.
8. From the Hub (``--only-stream``): ``dflash-convert --quant Q4_K_M`` from repo ids against a loopback Hub serving
   100 MB/s in total, a 3.2 GB Qwen3-4B-shaped target in 10 shards, streamed (kept, and ``--no-keep-source``)
   against ``snapshot_download`` of the same files and against downloading first, then converting: wall time and peak
   disk of the Hub cache plus the output folder; the files of the three runs compared.
The report starts with the kernel path the built-in quantizer uses (compiled or numpy).
Each tool runs in its own child process under /usr/bin/time -v (peak RSS = its max resident set,
file pages touched through mmap included); inputs are read once beforehand so both sides start
from a warm page cache. Not a test: numbers only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# numpy's OpenBLAS threads spin idle after its import and took up to a fifth of a core from the in-process kernel rows
# (ours and ggml's alike); nothing here uses BLAS. Set before numpy loads; the child processes inherit it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType, GGUFValueType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the fixture generator lives in tests/fixtures
import fixtures  # noqa: E402
import reference_env  # noqa: E402

H, LAYERS, TAPS, FF, HEADS, KV_HEADS, HEAD_DIM = 3840, 5, 6, 7680, 32, 8, 128


def _bf16_noise(rng: np.random.Generator, n: int) -> bytes:
    """Plausible small BF16 values (|x| in [2^-31, 2^-8)), fast to make."""
    u = rng.integers(0x3000, 0x3B80, size=n, dtype=np.uint16)
    return (u | (rng.integers(0, 2, size=n, dtype=np.uint16) << 15)).tobytes()


def make_big_drafter(root: Path) -> tuple[Path, Path]:
    """Write the synthetic drafter (streamed, one tensor at a time) and a matching Gemma-4 target dir."""
    target = fixtures.make_gemma4_target(root / "targets")
    cfg = json.loads((target / "config.json").read_text())
    cfg["text_config"].update(hidden_size=H, num_hidden_layers=48)
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    drafter = fixtures.make_drafter(root / "drafters", target="gemma4")  # tiny weights, replaced below
    dcfg = json.loads((drafter / "config.json").read_text())
    dcfg.update(hidden_size=H, num_hidden_layers=LAYERS, intermediate_size=FF, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_target_layers=48,
                layer_types=["sliding_attention"] * 4 + ["full_attention"])
    dcfg["dflash_config"]["target_layer_ids"] = [1, 10, 19, 28, 37, 46]
    (drafter / "config.json").write_text(json.dumps(dcfg, indent=2))
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (H, TAPS * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                   p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                   p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
                   p + "mlp.gate_proj.weight": (FF, H), p + "mlp.up_proj.weight": (FF, H),
                   p + "mlp.down_proj.weight": (H, FF)}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(shapes):
        n = int(np.prod(shapes[name])) * 2
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(0)
    with open(drafter / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name in sorted(shapes):
            f.write(_bf16_noise(rng, int(np.prod(shapes[name]))))
    return drafter, target


def _bf16_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator, sparse: bool = False):
    """A GGUF tensor of random BF16 (or a hole in a sparse file: verify only reads headers)."""
    from dflash_gguf.ggufio.writer import TensorOut

    ne = tuple(reversed(shape))
    n = int(np.prod(shape))

    def write(out) -> None:  # noqa: ANN001
        if sparse:  # a hole, but the last byte written so the file has its full length
            out.seek(n * 2 - 1, os.SEEK_CUR)
            out.write(b"\0")
            return
        for start in range(0, n, 1 << 24):
            out.write(_bf16_noise(rng, min(1 << 24, n - start)))

    return TensorOut(name, ne, GGMLQuantizationType.BF16 if len(shape) > 1 else GGMLQuantizationType.F32,
                     write if len(shape) > 1 else (lambda out: out.write(np.ones(n, np.float32).tobytes())))


def make_target_gguf(path: Path, drafter_gguf: Path | None, *, hidden: int, layers: int, ff: int, vocab: int,
                     sparse: bool = False) -> Path:
    """A llama-arch target GGUF (untied token_embd + output), BF16 matrices, F32 norms."""
    from dflash_gguf.ggufio.writer import GGUFPlan
    from dflash_gguf.verify import read_gguf

    plan = GGUFPlan("llama")
    plan.add_string("general.name", path.stem)
    for key, value in (("context_length", 4096), ("embedding_length", hidden), ("block_count", layers),
                       ("feed_forward_length", ff), ("attention.head_count", hidden // 128),
                       ("attention.head_count_kv", 8)):
        plan.add_uint32(f"llama.{key}", value)
    plan.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    plan.add_uint32("general.file_type", 32)
    if drafter_gguf is not None:  # the drafter's own vocabulary, so the pair checks pass
        for key, kv in read_gguf(drafter_gguf).kv.items():
            if key.startswith("tokenizer."):
                value = kv.value.tolist() if hasattr(kv.value, "tolist") else kv.value
                plan.add(key, GGUFValueType(kv.vtype), value, GGUFValueType(kv.subtype) if kv.subtype else None)
    else:
        plan.add_string("tokenizer.ggml.model", "llama")
        plan.add_array("tokenizer.ggml.tokens", [f"<t{i}>" for i in range(vocab)])
        plan.add_array("tokenizer.ggml.scores", [0.0] * vocab)
        plan.add_array("tokenizer.ggml.token_type", [1] * vocab)
    rng = np.random.default_rng(1)
    q, kv_dim = hidden, 8 * 128
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.attn_q.weight": (q, hidden),
                   f"blk.{i}.attn_k.weight": (kv_dim, hidden), f"blk.{i}.attn_v.weight": (kv_dim, hidden),
                   f"blk.{i}.attn_output.weight": (hidden, q), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.ffn_gate.weight": (ff, hidden), f"blk.{i}.ffn_up.weight": (ff, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, ff)}
    for name, shape in shapes.items():
        plan.add_tensor(_bf16_tensor(name, shape, rng, sparse))
    plan.write(path)
    return path


def timed(cmd: list[str], cwd: Path | None = None, ok_codes: tuple[int, ...] = (0,)) -> tuple[float, float]:
    """Run ``cmd`` under /usr/bin/time -v: (wall seconds, peak RSS in MB)."""
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdin=subprocess.DEVNULL)
    return _time_v(cmd, proc, ok_codes)


def _time_v(cmd: list[str], proc: subprocess.CompletedProcess[str], ok_codes: tuple[int, ...] = (0,)
            ) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) from /usr/bin/time -v's report; exit when the command failed."""
    if proc.returncode not in ok_codes:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", proc.stderr)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    assert wall and rss, proc.stderr[-2000:]
    seconds = int(wall.group(1) or 0) * 3600 + int(wall.group(2)) * 60 + float(wall.group(3))
    return seconds, int(rss.group(1)) / 1024


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def row(label: str, mb: float, ours: tuple[float, float], ref: tuple[float, float]) -> str:
    return (f"| {label} | {ours[0]:.2f} s | {mb / ours[0]:.0f} MB/s | {ours[1]:.0f} MB | {ref[0]:.2f} s | "
            f"{mb / ref[0]:.0f} MB/s | {ref[1]:.0f} MB | {ref[0] / ours[0]:.2f}x | {ours[1] / ref[1]:.2f}x |")


def quantize_both(src: Path, label: str, work: Path, ours_cli: Path, llama_quantize: Path) -> list[str]:
    """Q8_0 and Q4_0 with the built-in quantizer and llama-quantize; table rows, outputs compared."""
    from gguf_compare import read_tensors

    mb = src.stat().st_size / 1e6
    lines = []
    for qtype in ("Q8_0", "Q4_0"):
        ours_out, ref_out = work / f"builtin-{qtype}.gguf", work / f"llama-{qtype}.gguf"
        warm(src)
        ours = timed([str(ours_cli), "quantize", str(src), str(ours_out), qtype.lower(), "--quantizer", "builtin",
                      "--threads", "2"])
        warm(src)
        ref = timed([str(llama_quantize), str(src), str(ref_out), qtype, "2"])
        lines.append(row(f"quantize {label} ({mb:.0f} MB) -> {qtype}, 2 threads", mb, ours, ref))
        same = read_tensors(ours_out) == read_tensors(ref_out)
        lines.append(f"|   {qtype}: tensor names, types and bytes identical: {same} | | | | | | | | |")
        ours_out.unlink()
        warm(src)
        wrapped = timed([str(ours_cli), "quantize", str(src), str(ours_out), qtype.lower(), "--quantizer",
                         "llama-quantize", "--llama-quantize", str(llama_quantize), "--threads", "2"])
        lines.append(f"|   {qtype}: dflash-gguf wrapping llama-quantize {wrapped[0]:.2f} s vs llama-quantize alone "
                     f"{ref[0]:.2f} s: overhead {100 * (wrapped[0] / ref[0] - 1):+.0f}% | | | | | | | | |")
        ours_out.unlink()
        ref_out.unlink()
    return lines


# ------------------------------------------------------------------------------------- quantization kernels

def _best_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """The fastest of ``repeats`` runs (the machine may be shared)."""
    import time

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def kernel_rows(work: Path, venv_bin: Path, llama_quantize: Path) -> list[str]:
    """Per-thread quantization throughput: in-process kernels, then both tools end to end on one thread."""
    import ctypes

    from dflash_gguf.quantize import kernels

    Q = GGMLQuantizationType
    rng = np.random.default_rng(3)
    n = 1 << 23  # 8M values: 16 MB of BF16
    bf16 = np.frombuffer(_bf16_noise(rng, n), np.uint16)
    f32 = (bf16.astype(np.uint32) << 16).view(np.float32)
    ggml = ctypes.CDLL(str(llama_quantize.parent / "libggml-base.so"))
    levels = kernels.simd_levels()
    lines = ["| kernel, 1 thread (MB/s of BF16 input) | " + " | ".join(f"compiled, {lv}" for lv in levels) +
             " | numpy | b11434 quantize_row_*_ref (F32 in) | compiled / ggml |",
             "|---|" + "---|" * (len(levels) + 3)]
    out = np.empty(n * 2, np.uint8)  # more than any of the three needs
    previous, previous_simd = kernels.kernel_path(), kernels.simd()

    def compiled_speeds(run: Callable[[], object]) -> list[float]:
        """MB/s of ``run`` on the compiled kernels at each instruction set, lowest first."""
        speeds = []
        for level in levels:
            kernels.set_kernel_path("compiled")
            kernels.set_simd(level)
            speeds.append(bf16.nbytes / 1e6 / _best_seconds(run))
        return speeds

    for qtype, fname in ((Q.Q4_0, "q4_0"), (Q.Q8_0, "q8_0"), (Q.Q5_0, "q5_0"), (Q.Q5_1, "q5_1"), (Q.Q4_K, "q4_K"),
                         (Q.Q5_K, "q5_K"), (Q.Q6_K, "q6_K"), (Q.MXFP4, "mxfp4")):
        speeds = compiled_speeds(lambda q=qtype: kernels.quantize_rows(bf16, Q.BF16, q))
        kernels.set_kernel_path("numpy")
        numpy_speed = bf16.nbytes / 1e6 / _best_seconds(lambda q=qtype: kernels.quantize_rows(bf16, Q.BF16, q))
        ref = getattr(ggml, f"quantize_row_{fname}_ref")
        ref.restype, ref.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        ggml_speed = bf16.nbytes / 1e6 / _best_seconds(lambda r=ref: r(f32.ctypes.data, out.ctypes.data, n))
        best = speeds[-1] if speeds else float("nan")  # the widest instruction set: what runs by default
        lines.append(f"| {qtype.name} | " + " | ".join(f"{v:.0f}" for v in speeds) +
                     f" | {numpy_speed:.0f} | {ggml_speed:.0f} | {best / ggml_speed:.2f}x |")
    # with an importance matrix: ggml_quantize_chunk with quant_weights (what llama-quantize --imatrix runs)
    chunk = ggml.ggml_quantize_chunk
    chunk.restype = ctypes.c_size_t
    chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_void_p]
    ggml.ggml_quantize_init.argtypes = [ctypes.c_int]
    row_len = 4096
    importance = rng.uniform(0.01, 10.0, row_len).astype(np.float32)
    lines += ["", "| kernel with an importance matrix, 1 thread (MB/s of BF16 input, rows of 4096) | " +
              " | ".join(f"compiled, {lv}" for lv in levels) + " | b11434 ggml_quantize_chunk (F32 in) | "
              "compiled / ggml |", "|---|" + "---|" * (len(levels) + 2)]
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS):
        if not levels:
            break
        speeds = compiled_speeds(lambda q=qtype: kernels.quantize_weighted(bf16, Q.BF16, q, row_len, importance))
        ggml.ggml_quantize_init(int(qtype))
        ggml_speed = bf16.nbytes / 1e6 / _best_seconds(
            lambda q=qtype: chunk(int(q), f32.ctypes.data, out.ctypes.data, 0, n // row_len, row_len,
                                  importance.ctypes.data))
        lines.append(f"| {qtype.name} | " + " | ".join(f"{v:.0f}" for v in speeds) +
                     f" | {ggml_speed:.0f} | {speeds[-1] / ggml_speed:.2f}x |")
    kernels.set_kernel_path(previous)
    if previous_simd is not None:
        kernels.set_simd(previous_simd)

    from gguf_compare import read_tensors

    # Python's start-up and imports are a fixed cost, large next to these files, negligible for a 12B model
    startup = min(timed([str(venv_bin / "dflash-gguf"), "--help"])[0] for _ in range(3))
    lines += ["", "| quantize end to end, 1 thread | dflash-gguf builtin | MB/s | MB/s after start-up | peak RSS | "
              "llama-quantize | MB/s | peak RSS | speed-up | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    layers = make_target_gguf(work / "kern-layers-BF16.gguf", None, hidden=2048, layers=4, ff=5632, vocab=256)
    embd = make_target_gguf(work / "kern-embd-BF16.gguf", None, hidden=2048, layers=1, ff=256, vocab=65536)
    os.sync()  # the files' writeback would otherwise run under the first rows
    q6 = ["--output-tensor-type", "q6_k", "--token-embedding-type", "q6_k"]
    for label, src, type_name, extra in (("Q4_0", layers, "q4_0", []), ("Q8_0", layers, "q8_0", []),
                                         ("Q4_K_M", layers, "q4_k_m", []), ("Q4_K_S", layers, "q4_k_s", []),
                                         ("Q5_K_M", layers, "q5_k_m", []), ("Q6_K", layers, "q6_k", []),
                                         ("Q5_0", layers, "q5_0", []), ("Q5_1", layers, "q5_1", []),
                                         ("Q6_K (q8_0 file, Q6_K embd/output)", embd, "q8_0", q6),
                                         ("F16", layers, "f16", []), ("BF16 (a copy)", layers, "bf16", [])):
        mb = src.stat().st_size / 1e6
        ours_out, ref_out = work / "kern-ours.gguf", work / "kern-ref.gguf"
        warm(src)
        ours = timed([str(venv_bin / "dflash-gguf"), "quantize", str(src), str(ours_out), type_name, "--quantizer",
                      "builtin", "--threads", "1", *extra])
        warm(src)
        ref = timed([str(llama_quantize), *extra, str(src), str(ref_out), type_name.upper(), "1"])
        same = read_tensors(ours_out) == read_tensors(ref_out)
        lines.append(f"| {label} ({mb:.0f} MB BF16) | {ours[0]:.2f} s | {mb / ours[0]:.0f} | "
                     f"{mb / max(1e-3, ours[0] - startup):.0f} | {ours[1]:.0f} MB | {ref[0]:.2f} s | "
                     f"{mb / ref[0]:.0f} | {ref[1]:.0f} MB | {ref[0] / ours[0]:.2f}x | {same} |")
        ours_out.unlink()
        ref_out.unlink()
    lines.append(f"|   dflash-gguf start-up (Python, imports; `dflash-gguf --help`): {startup:.2f} s "
                 "| | | | | | | | | |")
    layers.unlink()
    embd.unlink()
    return lines


# ----------------------------------------------------------------------------- target conversion rows

_ITEMSIZE = {"BF16": 2, "F32": 4, "U8": 1, "E8M0": 1, "F8_E4M3": 1}


def _noise_chunks(dtype: str, shape: tuple[int, ...], rng: np.random.Generator):  # noqa: ANN202
    """The bytes of one noise tensor of ``dtype``, in chunks of at most 16M values: BF16 small values (1-D ones
    1.0); F32 1.0 (1-D) or block scales around 1/448 (2-D, as FP8 checkpoints hold them); U8 random bytes (MXFP4
    codes); E8M0 exponents 118..129 (MXFP4 scales 2^-9..2^2, stored U8); F8_E4M3 random bytes but NaN (0x7F/0xFF)."""
    n = int(np.prod(shape))
    for start in range(0, n, 1 << 24):
        m = min(1 << 24, n - start)
        if dtype == "BF16":
            yield np.full(m, 0x3F80, np.uint16).tobytes() if len(shape) == 1 else _bf16_noise(rng, m)
        elif dtype == "F32":
            yield (np.ones(m, np.float32) if len(shape) == 1
                   else rng.uniform(2e-5, 2e-4, size=m).astype(np.float32)).tobytes()
        elif dtype == "U8":
            yield rng.integers(0, 256, size=m, dtype=np.uint8).tobytes()
        elif dtype == "E8M0":
            yield rng.integers(118, 130, size=m, dtype=np.uint8).tobytes()
        elif dtype == "F8_E4M3":
            raw = rng.integers(0, 256, size=m, dtype=np.uint8)
            raw[(raw & 0x7F) == 0x7F] ^= 0x01  # e4m3fn's only non-finite codes: NaN
            yield raw.tobytes()
        else:
            raise ValueError(dtype)


def _module_order(name: str) -> tuple[int, int, str]:
    """transformers' module order, which save_pretrained shards by: the embedding, each layer in turn, then the rest."""
    m = re.search(r"\.layers\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if "embed" in name else 2, 0, name)


def _write_noise_checkpoint(model_dir: Path, shapes: dict[str, tuple[int, ...]], n_shards: int,
                            dtypes: dict[str, str] | None = None, cut: bool = False) -> float:
    """Random weights for ``shapes`` (BF16 unless ``dtypes`` names another: see ``_noise_chunks``; 1-D BF16 ones
    1.0), streamed into ``n_shards`` safetensors + index, each file ordered as safetensors.save_file orders it
    (larger dtypes first, then by name). The tensors are dealt to the shards in turn (every shard then holds part of
    every layer), or with ``cut`` cut in module order into shards of about equal bytes, as save_pretrained cuts them."""
    dtypes = dtypes or {}
    names = sorted(shapes)
    parts = [names[i::n_shards] for i in range(n_shards)] if n_shards > 1 else [names]
    if cut and n_shards > 1:
        ordered = sorted(names, key=_module_order)
        sizes = [int(np.prod(shapes[n])) * _ITEMSIZE[dtypes.get(n, "BF16")] for n in ordered]
        step, parts, acc = sum(sizes) / n_shards, [[] for _ in range(n_shards)], 0
        for name, size in zip(ordered, sizes, strict=True):
            parts[min(int(acc // step), n_shards - 1)].append(name)
            acc += size
        parts = [part for part in parts if part]
        n_shards = len(parts)
    rng = np.random.default_rng(2)
    weight_map: dict[str, str] = {}
    total = 0
    for i, part in enumerate(parts, start=1):
        fname = f"model-{i:05d}-of-{n_shards:05d}.safetensors" if n_shards > 1 else "model.safetensors"
        part = sorted(part, key=lambda name: (-_ITEMSIZE[dtypes.get(name, "BF16")], name))
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in part:
            dtype = dtypes.get(name, "BF16")
            n = int(np.prod(shapes[name])) * _ITEMSIZE[dtype]
            header[name] = {"dtype": "U8" if dtype == "E8M0" else dtype, "shape": list(shapes[name]),
                            "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(model_dir / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for name in part:
                for chunk in _noise_chunks(dtypes.get(name, "BF16"), shapes[name], rng):
                    f.write(chunk)
        total += offset
    if n_shards > 1:
        (model_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total / 1e6


def make_big_gemma4_target(root: Path, layers: int) -> tuple[Path, float]:
    """Gemma-4 12B's layout scaled down (H 3072, 5 sliding : 1 full, k_eq_v full layers, head dims 256/512,
    tied embeddings), the fixture's 512-token tokenizer; 10 layers ~3 GB. Returns (dir, MB of weights)."""
    d = fixtures.make_gemma4_target(root, name_suffix=f"-bench-{layers}l")
    for p in d.glob("model*.safetensors"):
        p.unlink()
    h, nh, hd, hd_full, kv, kv_full, ff, vocab = 3072, 16, 256, 512, 8, 2, 12288, 512
    types = ["full_attention" if i % 6 == 5 or i == layers - 1 else "sliding_attention" for i in range(layers)]
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"].update(hidden_size=h, num_attention_heads=nh, head_dim=hd, global_head_dim=hd_full,
                              num_key_value_heads=kv, num_global_key_value_heads=kv_full, intermediate_size=ff,
                              num_hidden_layers=layers, layer_types=types, vocab_size=vocab, sliding_window=1024)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d, _write_noise_checkpoint(d, _gemma4_shapes(h, nh, hd, hd_full, kv, kv_full, ff, vocab, types), n_shards=2)


def _gemma4_shapes(h: int, nh: int, hd: int, hd_full: int, kv: int, kv_full: int, ff: int, vocab: int,
                   types: list[str]) -> dict[str, tuple[int, ...]]:
    """The text-model tensors of a tied Gemma-4 checkpoint (k_eq_v full layers: no v_proj there)."""
    lm = "model.language_model"
    shapes: dict[str, tuple[int, ...]] = {f"{lm}.embed_tokens.weight": (vocab, h), f"{lm}.norm.weight": (h,)}
    for i, t in enumerate(types):
        p, full = f"{lm}.layers.{i}.", t == "full_attention"
        d_head, n_kv = (hd_full, kv_full) if full else (hd, kv)
        shapes |= {p + "self_attn.q_proj.weight": (nh * d_head, h), p + "self_attn.k_proj.weight": (n_kv * d_head, h),
                   p + "self_attn.o_proj.weight": (h, nh * d_head), p + "self_attn.q_norm.weight": (d_head,),
                   p + "self_attn.k_norm.weight": (d_head,), p + "mlp.gate_proj.weight": (ff, h),
                   p + "mlp.up_proj.weight": (ff, h), p + "mlp.down_proj.weight": (h, ff), p + "layer_scalar": (1,)}
        shapes |= {p + n + ".weight": (h,) for n in ("input_layernorm", "post_attention_layernorm",
                                                     "pre_feedforward_layernorm", "post_feedforward_layernorm")}
        if not full:
            shapes[p + "self_attn.v_proj.weight"] = (n_kv * d_head, h)
    return shapes


def _qwen3_attention_shapes(p: str, h: int, nh: int, kv: int, hd: int) -> dict[str, tuple[int, ...]]:
    """A Qwen3 block's norms and attention (q/k norms included), under the layer prefix ``p``."""
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
            p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}


def make_big_qwen3_target(root: Path, layers: int, tied: bool, *, hidden: int = 2048, heads: int = 16,
                          ff: int = 6144, n_shards: int | None = None, cut: bool = False) -> tuple[Path, float]:
    """Qwen3-1.7B's layout (H 2048, 16/8 heads of 128, FF 6144, 151936-row vocabulary) with ``layers`` layers;
    18 untied layers ~3 GB, 9 tied ~1.5 GB; Qwen3-4B's with ``hidden=2560, heads=32, ff=9728`` (12 tied layers
    ~3.2 GB). Returns (dir, MB of weights)."""
    src = fixtures.make_qwen3_target(root / f"qwen-{layers}l", llama_cpp_src=reference_env.llama_cpp_src(),
                                     weights=False, tied=tied)
    h, nh, kv, hd, vocab = hidden, heads, 8, 128, 151936
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(hidden_size=h, num_attention_heads=nh, num_key_value_heads=kv, head_dim=hd, intermediate_size=ff,
               num_hidden_layers=layers, max_window_layers=layers, vocab_size=vocab)
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= _qwen3_attention_shapes(p, h, nh, kv, hd) | {
            p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h), p + "mlp.down_proj.weight": (h, ff)}
    return src, _write_noise_checkpoint(src, shapes, n_shards=n_shards or (2 if layers > 9 else 1), cut=cut)


def make_big_qwen3moe_target(root: Path, layers: int = 2) -> tuple[Path, float]:
    """Qwen3-30B-A3B's layout scaled down: H 2048, 32/4 heads of 128, 64 experts of width 768 (8 used), one BF16
    tensor per expert projection, router ``mlp.gate``, the 151936-row vocabulary, tied embeddings (untied, the
    two 151936 x 2048 matrices alone would be 1.2 GB); 2 layers ~1.9 GB in 2 shards. Returns (dir, MB)."""
    src = fixtures.make_qwen3moe_target(root, llama_cpp_src=reference_env.llama_cpp_src(), tied=True, weights=False)
    h, nh, kv, hd, experts, mf, vocab = 2048, 32, 4, 128, 64, 768, 151936
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(hidden_size=h, num_attention_heads=nh, num_key_value_heads=kv, head_dim=hd, intermediate_size=6144,
               moe_intermediate_size=mf, num_experts=experts, num_experts_per_tok=8, num_hidden_layers=layers,
               max_window_layers=layers, vocab_size=vocab)
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= _qwen3_attention_shapes(p, h, nh, kv, hd) | {p + "mlp.gate.weight": (experts, h)}
        for e in range(experts):
            shapes |= {f"{p}mlp.experts.{e}.gate_proj.weight": (mf, h), f"{p}mlp.experts.{e}.up_proj.weight": (mf, h),
                       f"{p}mlp.experts.{e}.down_proj.weight": (h, mf)}
    return src, _write_noise_checkpoint(src, shapes, n_shards=2)


def make_big_gpt_oss_target(root: Path, layers: int = 4) -> tuple[Path, float]:
    """openai/gpt-oss-20b's layout scaled down: H 1440 (half of 2880: with the fixture's 151936-row Qwen vocabulary,
    the untied embeddings at 2880 would be 1.75 GB alone), 64/8 heads of 64, 32 MXFP4 experts of width 1440 (4 used)
    as ``*_blocks`` (random U8) + ``*_scales`` (E8M0 118..129), BF16 attention with biases and sinks, router with
    bias, sliding/full layers alternating; 4 layers ~1.4 GB. Returns (dir, MB)."""
    src = fixtures.make_gpt_oss_target(root, llama_cpp_src=reference_env.llama_cpp_src(), weights=False)
    h, nh, kv, hd, experts, ff = 1440, 64, 8, 64, 32, 1440
    vocab = fixtures.SIZES["qwen_vocab"]
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(hidden_size=h, num_attention_heads=nh, num_key_value_heads=kv, head_dim=hd, intermediate_size=ff,
               num_local_experts=experts, experts_per_token=4, num_experts_per_tok=4, num_hidden_layers=layers,
               layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
               vocab_size=vocab)
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (vocab, h)}
    dtypes: dict[str, str] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.q_proj.bias": (nh * hd,),
                   p + "self_attn.k_proj.weight": (kv * hd, h), p + "self_attn.k_proj.bias": (kv * hd,),
                   p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.v_proj.bias": (kv * hd,),
                   p + "self_attn.o_proj.weight": (h, nh * hd), p + "self_attn.o_proj.bias": (h,),
                   p + "self_attn.sinks": (nh,), p + "mlp.router.weight": (experts, h),
                   p + "mlp.router.bias": (experts,), p + "mlp.experts.gate_up_proj_bias": (experts, 2 * ff),
                   p + "mlp.experts.down_proj_bias": (experts, h)}
        for proj, rows, cols in (("gate_up_proj", 2 * ff, h), ("down_proj", h, ff)):
            shapes |= {f"{p}mlp.experts.{proj}_blocks": (experts, rows, cols // 32, 16),
                       f"{p}mlp.experts.{proj}_scales": (experts, rows, cols // 32)}
            dtypes |= {f"{p}mlp.experts.{proj}_blocks": "U8", f"{p}mlp.experts.{proj}_scales": "E8M0"}
    return src, _write_noise_checkpoint(src, shapes, n_shards=1, dtypes=dtypes)


def make_big_minimax_m2_target(root: Path, layers: int = 4) -> tuple[Path, float]:
    """MiniMax-M2's layout scaled down: H 1536 (half of 3072), 24/4 heads of 128 (rotary 64), 32 experts of width
    768 (8 used) ``block_sparse_moe.experts.N.w1/w2/w3``; every attention and expert matrix F8_E4M3 (no NaN) with
    an F32 ``weight_scale_inv`` per 128x128 block; embeddings, lm_head, norms and the router BF16,
    ``e_score_correction_bias`` F32; 4 layers ~1.4 GB in 2 shards. Returns (dir, MB)."""
    src = fixtures.make_minimax_m2_target(root, llama_cpp_src=reference_env.llama_cpp_src())
    for p in src.glob("model*.safetensors*"):
        p.unlink()
    h, nh, kv, hd, experts, mf, block = 1536, 24, 4, 128, 32, 768, 128
    vocab = fixtures.SIZES["qwen_vocab"]
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(hidden_size=h, num_attention_heads=nh, num_key_value_heads=kv, head_dim=hd, rotary_dim=64,
               intermediate_size=mf, num_local_experts=experts, num_experts_per_tok=8, num_hidden_layers=layers,
               attn_type_list=[1] * layers, vocab_size=vocab)
    assert cfg["quantization_config"]["weight_block_size"] == [block, block]
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (vocab, h)}
    dtypes: dict[str, str] = {}

    def fp8(name: str, shape: tuple[int, int]) -> None:
        shapes[name] = shape
        shapes[name + "_scale_inv"] = (-(-shape[0] // block), -(-shape[1] // block))
        dtypes[name], dtypes[name + "_scale_inv"] = "F8_E4M3", "F32"

    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("q_proj", (nh * hd, h)), ("k_proj", (kv * hd, h)), ("v_proj", (kv * hd, h)),
                            ("o_proj", (h, nh * hd))):
            fp8(f"{p}self_attn.{name}.weight", shape)
        shapes |= {p + "self_attn.q_norm.weight": (nh * hd,), p + "self_attn.k_norm.weight": (kv * hd,),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "block_sparse_moe.gate.weight": (experts, h),
                   p + "block_sparse_moe.e_score_correction_bias": (experts,)}
        dtypes[p + "block_sparse_moe.e_score_correction_bias"] = "F32"
        for e in range(experts):
            for w, shape in (("w1", (mf, h)), ("w2", (h, mf)), ("w3", (mf, h))):
                fp8(f"{p}block_sparse_moe.experts.{e}.{w}.weight", shape)
    return src, _write_noise_checkpoint(src, shapes, n_shards=2, dtypes=dtypes)


def target_rows(work: Path, venv_bin: Path, ref_py: str, *, classic: bool = True, moe: bool = True) -> list[str]:
    """convert-target vs b11434's converter, default outtype on both sides: ``classic``, ~3 GB and ~1.5 GB
    Gemma-4- and Qwen3-shaped targets (BF16); ``moe``, ~1.4-1.9 GB Qwen3-MoE- (BF16 experts), gpt-oss- (MXFP4
    experts) and MiniMax-M2-shaped (FP8 block-scaled) ones. Each case's files are deleted after its row."""
    from gguf_compare import diff

    lines = []
    cases = []
    if classic:
        cases += [("Gemma-4-shaped target, 10 layers", "BF16", lambda: make_big_gemma4_target(work / "tg", 10)),
                  ("Gemma-4-shaped target, 5 layers", "BF16", lambda: make_big_gemma4_target(work / "tg", 5)),
                  ("Qwen3-shaped target, 18 layers, untied", "BF16",
                   lambda: make_big_qwen3_target(work / "tq", 18, False)),
                  ("Qwen3-shaped target, 9 layers, tied", "BF16", lambda: make_big_qwen3_target(work / "tq", 9, True))]
    if moe:
        cases += [("Qwen3-MoE-shaped target, 2 layers x 64 experts, tied", "BF16",
                   lambda: make_big_qwen3moe_target(work / "tm", 2)),
                  ("gpt-oss-shaped target, 4 layers x 32 experts", "BF16 + MXFP4",
                   lambda: make_big_gpt_oss_target(work / "to", 4)),
                  ("MiniMax-M2-shaped target, 4 layers x 32 experts", "FP8 + BF16",
                   lambda: make_big_minimax_m2_target(work / "tx", 4))]
    for label, kind, make in cases:
        model, mb = make()
        ours_out, ref_out = work / "target-ours.gguf", work / "target-ref.gguf"
        for p in model.glob("model*.safetensors"):
            warm(p)
        ours = timed([str(venv_bin / "dflash-gguf"), "convert-target", str(model), "--outfile", str(ours_out)])
        for p in model.glob("model*.safetensors"):
            warm(p)
        ref = timed([ref_py, str(reference_env.convert_script()), str(model), "--outfile", str(ref_out)], cwd=work)
        problems = diff(ours_out, ref_out)
        lines.append(row(f"convert {label} ({mb:.0f} MB {kind})", mb, ours, ref))
        lines.append(f"|   parity with b11434: {'identical' if not problems else problems[:3]} | | | | | | | | |")
        ours_out.unlink()
        ref_out.unlink()
        shutil.rmtree(model)
    return lines


def kquant_disk_rows(work: Path, venv_bin: Path, ref_py: str, llama_quantize: Path) -> list[str]:
    """The Q4_K_M one pass against the disk: a Qwen3-4B-shaped target (H 2560, 12 layers, tied 151936-row
    vocabulary, two shards, 3.2 GB BF16), the page cache dropped before each step (root only; else warm, and said):
    ``cat`` of the shards, ``dflash-gguf convert-target --quant Q4_K_M`` (threads: the machine's cores), and b11434's
    convert + ``llama-quantize Q4_K_M`` with as many threads, whose output ours must equal."""
    from gguf_compare import diff

    from dflash_gguf.cores import machine_cores

    model, mb = make_big_qwen3_target(work / "tk", 12, True, hidden=2560, heads=32, ff=9728)
    shards = sorted(model.glob("model*.safetensors"))
    cores = machine_cores()

    def fresh() -> str:
        if drop_caches():
            return "cold"
        for p in shards:
            warm(p)
        return "warm (not root: the page cache could not be dropped)"

    cache = fresh()
    cat = timed(["sh", "-c", "cat " + " ".join(f"'{p}'" for p in shards) + " > /dev/null"])
    ours_out, bf16, ref_out = work / "kq-ours.gguf", work / "kq-BF16.gguf", work / "kq-ref.gguf"
    fresh()
    ours = timed([str(venv_bin / "dflash-gguf"), "convert-target", str(model), "--quant", "q4_k_m", "--outfile",
                  str(ours_out)])
    fresh()
    conv = timed([ref_py, str(reference_env.convert_script()), str(model), "--outtype", "bf16", "--outfile",
                  str(bf16)], cwd=work)
    quant = timed([str(llama_quantize), str(bf16), str(ref_out), "Q4_K_M", str(cores)])
    problems = diff(ours_out, ref_out)
    ref = (conv[0] + quant[0], max(conv[1], quant[1]))
    lines = [f"| Q4_K_M one pass, Qwen3-4B-shaped target ({mb:.0f} MB BF16, 2 shards, inputs {cache}, "
             f"{cores} threads) | time | MB/s of BF16 | peak RSS | vs `cat` |", "|---|---|---|---|---|",
             f"| `cat` of the shards | {cat[0]:.2f} s | {mb / cat[0]:.0f} | | 1x |",
             f"| dflash-gguf convert-target --quant Q4_K_M | {ours[0]:.2f} s | {mb / ours[0]:.0f} | {ours[1]:.0f} MB | "
             f"{ours[0] / cat[0]:.2f}x |",
             f"| b11434 convert (BF16) + llama-quantize Q4_K_M {cores} | {ref[0]:.2f} s ({conv[0]:.1f} + "
             f"{quant[0]:.1f}) | {mb / ref[0]:.0f} | {ref[1]:.0f} MB | {ref[0] / cat[0]:.2f}x |",
             f"|   ours {ref[0] / ours[0]:.2f}x faster; output {'identical' if not problems else problems[:3]} "
             "| | | | |"]
    for p in (ours_out, bf16, ref_out):
        p.unlink()
    shutil.rmtree(model)
    return lines


def make_big_gemma4_vision_target(root: Path) -> tuple[Path, float]:
    """A Gemma-4-shaped target whose vision tower is near real size (16 layers of width 768, FF 3072, 12 heads of
    64: ~150 M weights) beside a one-layer language model; the fixture's processor_config.json and tokenizer.
    Returns (dir, MB of the tower's weights)."""
    from dflash_gguf.convert.targets.gemma4 import Gemma4Projector
    from dflash_gguf.convert.targets.projector import ProjectorSource

    d = fixtures.make_gemma4_target(root, name_suffix="-bench-vision", towers="vision")
    for p in d.glob("model*.safetensors"):
        p.unlink()
    h, nh, hd, hd_full, kv, kv_full, ff, vocab = 3072, 16, 256, 512, 8, 2, 12288, 512
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"].update(hidden_size=h, num_attention_heads=nh, head_dim=hd, global_head_dim=hd_full,
                              num_key_value_heads=kv, num_global_key_value_heads=kv_full, intermediate_size=ff,
                              num_hidden_layers=1, layer_types=["full_attention"], vocab_size=vocab,
                              sliding_window=1024)
    cfg["vision_config"].update(hidden_size=768, intermediate_size=3072, num_hidden_layers=16,
                                num_attention_heads=12, num_key_value_heads=12, head_dim=64)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    arch = cfg["architectures"][0]
    tower = {name: e.shape for name, e in
             Gemma4Projector(ProjectorSource(d, d / "config.json", arch, cfg, {})).expected().items() if e.required}
    _write_noise_checkpoint(d, {**_gemma4_shapes(h, nh, hd, hd_full, kv, kv_full, ff, vocab, ["full_attention"]),
                                **tower}, n_shards=2)
    return d, sum(int(np.prod(s)) for s in tower.values()) * 2 / 1e6


def projector_rows(work: Path, venv_bin: Path, ref_py: str) -> list[str]:
    """convert-target --mmproj vs b11434's convert_hf_to_gguf.py --mmproj, default outtype on both sides, on a
    Gemma-4-shaped target with a ~300 MB BF16 vision tower."""
    from gguf_compare import diff

    model, mb = make_big_gemma4_vision_target(work / "tv")
    ours_out, ref_out = work / "mmproj-ours.gguf", work / "mmproj-ref.gguf"
    for p in model.glob("model*.safetensors"):
        warm(p)
    ours = timed([str(venv_bin / "dflash-gguf"), "convert-target", str(model), "--mmproj", "--outfile", str(ours_out)])
    for p in model.glob("model*.safetensors"):
        warm(p)
    ref = timed([ref_py, str(reference_env.convert_script()), str(model), "--mmproj", "--outfile", str(ref_out)],
                cwd=work)
    problems = diff(ours_out, ref_out)
    lines = [row(f"projector (mmproj) of a Gemma-4-shaped vision tower ({mb:.0f} MB BF16)", mb, ours, ref),
             f"|   parity with b11434: {'identical' if not problems else problems[:3]} | | | | | | | | |"]
    for path in (ours_out, ref_out):
        path.unlink()
    shutil.rmtree(model)
    return lines


# ------------------------------------------------------------------------------------- the whole pipeline

def timed_disk(cmd: list[str], folder: Path, env: dict[str, str] | None = None, cwd: Path | None = None
               ) -> tuple[float, float, float]:
    """Run ``cmd`` under /usr/bin/time -v, polling the size of ``folder``: (wall s, peak RSS MB, peak disk MB)."""
    import threading
    import time

    peak = 0
    stop = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not stop.is_set():
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
            peak = max(peak, size)
            time.sleep(0.05)

    folder.mkdir(parents=True, exist_ok=True)
    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=cwd, capture_output=True, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, stdin=subprocess.DEVNULL)
    finally:
        stop.set()
        thread.join()
    return (*_time_v(cmd, proc), peak / 1e6)


def make_pipeline_drafter(root: Path, target: Path, n_layers: int, *, h: int = 3072, ff: int = 6144,
                          taps: list[int] | None = None) -> Path:
    """A DFlash drafter (5 layers, 32/8 heads of 128) for a Gemma-4-shaped bench target: by default ~1.1 GB,
    hidden 3072 and 4 taps; at hidden 3840, FF 7680 and 6 taps the ~1.45 GB of z-lab/gemma4-12B-it-DFlash."""
    heads, kv, hd = 32, 8, 128
    taps = taps or [1, 3, 5, n_layers - 2]
    drafter = fixtures.make_drafter(root, target="gemma4")
    for p in drafter.glob("model*.safetensors"):
        p.unlink()
    dcfg = json.loads((drafter / "config.json").read_text())
    dcfg.update(hidden_size=h, num_hidden_layers=5, intermediate_size=ff, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=hd, num_target_layers=n_layers,
                layer_types=["sliding_attention"] * 4 + ["full_attention"])
    dcfg["dflash_config"]["target_layer_ids"] = taps
    (drafter / "config.json").write_text(json.dumps(dcfg, indent=2))
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, len(taps) * h), "hidden_norm.weight": (h,),
                                          "norm.weight": (h,)}
    for i in range(5):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                   p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                   p + "mlp.down_proj.weight": (h, ff)}
    _write_noise_checkpoint(drafter, shapes, n_shards=1)
    return drafter


def pipeline_rows(work: Path, venv_bin: Path, ref_py: str, llama_quantize: Path) -> list[str]:
    """dflash-convert's whole pipeline (local folders) vs the manual workflow: b11434's converter twice, then
    llama-quantize twice, on the ~3 GB Gemma-4-shaped target and a ~1.1 GB drafter; wall time and peak disk."""
    layers = 10
    target, t_mb = make_big_gemma4_target(work / "pt", layers)
    drafter = make_pipeline_drafter(work / "pd", target, layers)
    mb = t_mb + sum(p.stat().st_size for p in drafter.glob("*.safetensors")) / 1e6
    lines = ["| pipeline (local folders) | dflash-gguf | peak RSS | peak disk | manual b11434 workflow | peak RSS | "
             "peak disk | speed-up | disk ratio |", "|---|---|---|---|---|---|---|---|---|"]
    manual_dir = work / "manual"
    manual_dir.mkdir()
    t_bf16, d_bf16 = manual_dir / "target-BF16.gguf", manual_dir / "drafter-BF16.gguf"
    steps = [([ref_py, str(reference_env.convert_script()), str(target), "--outfile", str(t_bf16)], {}),
             ([ref_py, str(reference_env.convert_script()), str(drafter), "--target-model-dir", str(target),
               "--outfile", str(d_bf16)], {}),
             ([str(llama_quantize), str(t_bf16), str(manual_dir / "target-Q4_0.gguf"), "Q4_0", "2"], {}),
             ([str(llama_quantize), str(d_bf16), str(manual_dir / "drafter-Q4_0.gguf"), "Q4_0", "2"], {})]
    for p in [*target.glob("*.safetensors"), *drafter.glob("*.safetensors")]:
        warm(p)
    manual = [timed_disk(cmd, manual_dir, env, cwd=work) for cmd, env in steps]
    m_wall, m_rss = sum(r[0] for r in manual), max(r[1] for r in manual)
    m_disk = max(r[2] for r in manual)  # the BF16 files stay until the user deletes them
    runs = [("built-in quantizer, one pass", "builtin"), ("with llama-quantize", "llama-quantize")]
    for label, quantizer in runs:
        out = work / f"pair-{quantizer}"
        for p in [*target.glob("*.safetensors"), *drafter.glob("*.safetensors")]:
            warm(p)
        ours = timed_disk([str(venv_bin / "dflash-convert"), "--target", str(target), "--drafter", str(drafter),
                           "--quant", "q4_0", "--quantizer", quantizer, "--outdir", str(out)], out,
                          {"LLAMA_QUANTIZE": str(llama_quantize)}, cwd=work)
        lines.append(f"| {label} ({mb:.0f} MB BF16 in) | {ours[0]:.2f} s | {ours[1]:.0f} MB | {ours[2]:.0f} MB | "
                     f"{m_wall:.2f} s | {m_rss:.0f} MB | {m_disk:.0f} MB | {m_wall / ours[0]:.2f}x | "
                     f"{ours[2] / m_disk:.2f}x |")
        shutil.rmtree(out)
    lines.append(f"|   manual steps: {', '.join(f'{r[0]:.1f} s' for r in manual)} (convert target, convert drafter, "
                 "quantize target, quantize drafter) | | | | | | | | |")
    # Q4_K_M: the manual workflow's convert steps as above, then llama-quantize Q4_K_M for the target
    k_steps = [([str(llama_quantize), str(t_bf16), str(manual_dir / "target-Q4_K_M.gguf"), "Q4_K_M", "2"], {}),
               ([str(llama_quantize), str(d_bf16), str(manual_dir / "drafter-Q8_0.gguf"), "Q8_0", "2"], {})]
    k_manual = [*manual[:2], *(timed_disk(cmd, manual_dir, env, cwd=work) for cmd, env in k_steps)]
    k_wall = sum(r[0] for r in k_manual)
    out = work / "pair-q4_k_m"
    inputs = [*target.glob("*.safetensors"), *drafter.glob("*.safetensors")]
    for p in inputs:
        warm(p)
    read = timed(["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, inputs)])[0]  # reading the input once
    ours = timed_disk([str(venv_bin / "dflash-convert"), "--target", str(target), "--drafter", str(drafter),
                       "--quant", "q4_k_m", "--quantizer", "builtin", "--outdir", str(out)], out, cwd=work)
    lines.append(f"| --quant q4_k_m, built-in, one pass ({mb:.0f} MB BF16 in) | {ours[0]:.2f} s | {ours[1]:.0f} MB | "
                 f"{ours[2]:.0f} MB | {k_wall:.2f} s | {max(r[1] for r in k_manual):.0f} MB | "
                 f"{max(r[2] for r in k_manual):.0f} MB | {k_wall / ours[0]:.2f}x | "
                 f"{ours[2] / max(r[2] for r in k_manual):.2f}x |")
    lines.append(f"|   q4_k_m: {ours[0] / read:.2f}x the time cat takes to read the input ({read:.2f} s, page cache) "
                 "| | | | | | | | |")
    shutil.rmtree(out)
    lines += imatrix_rows(work, venv_bin, target, drafter, inputs, mb, t_bf16, manual[0], llama_quantize)
    shutil.rmtree(manual_dir)
    lines += tags_rows(work, venv_bin, target, drafter, inputs, mb)
    shutil.rmtree(target)
    shutil.rmtree(drafter)
    return lines


def imatrix_rows(work: Path, venv_bin: Path, target: Path, drafter: Path, inputs: list[Path], mb: float,
                 t_bf16: Path, convert: tuple[float, float, float], llama_quantize: Path) -> list[str]:
    """An importance-matrix Q4_K_M: the manual b11434 workflow (the converter's BF16 file, llama-imatrix over a
    calibration text, llama-quantize --imatrix) against dflash-convert --imatrix FILE (the same matrix; the built-in's
    weighted kernels in one pass from safetensors) and --imatrix auto (llama-imatrix on the run's own BF16 file, then
    the built-in from it). Parity: the one pass's target against llama-quantize --imatrix's."""
    from gguf_compare import diff

    calib = work / "calib" / "calib.txt"
    calib.parent.mkdir(exist_ok=True)
    words = ("the model reads a long text and predicts each next token from the ones before it; " * 400).split()
    calib.write_text(" ".join(words[i % len(words)] + ("." if i % 17 == 16 else "") for i in range(6000)))
    bins = Path(llama_quantize).parent
    matrix = calib.parent / f"imatrix-{target.name}.gguf"  # the name the pipeline gives its copy: the same keys
    by_hand = timed_disk([str(bins / "llama-imatrix"), "-m", str(t_bf16), "-f", calib.name, "-o", str(matrix),
                          "-c", "128", "--chunks", "4", "-t", "2", "--no-ppl"], calib.parent, cwd=calib.parent)
    ref_out = work / "manual-imatrix-Q4_K_M.gguf"
    quant = timed_disk([str(llama_quantize), "--imatrix", matrix.name, str(t_bf16), str(ref_out), "Q4_K_M", "2"],
                       calib.parent, cwd=calib.parent)
    manual_wall = convert[0] + by_hand[0] + quant[0]
    manual_rss = max(convert[1], by_hand[1], quant[1])
    lines = []
    for label, args in (("--imatrix FILE, one pass", ["--imatrix", str(matrix)]),
                        ("--imatrix auto", ["--imatrix", "auto", "--calibration", str(calib), "--calibration-ctx",
                                            "128", "--calibration-chunks", "4"])):
        out = work / "pair-imatrix"
        for p in inputs:
            warm(p)
        ours = timed_disk([str(venv_bin / "dflash-convert"), "--target", str(target), "--drafter", str(drafter),
                           "--quant", "q4_k_m", *args, "--outdir", str(out)], out,
                          {"LLAMA_IMATRIX": str(bins / "llama-imatrix"), "LLAMA_QUANTIZE": str(llama_quantize)},
                          cwd=work)
        made = next(out.glob("*-Q4_K_M.gguf"))
        same = diff(made, ref_out) if label.startswith("--imatrix FILE") else None
        baseline = convert[0] + quant[0] if label.startswith("--imatrix FILE") else manual_wall
        lines.append(f"| Q4_K_M with an importance matrix, {label} ({mb:.0f} MB BF16 in) | {ours[0]:.2f} s | "
                     f"{ours[1]:.0f} MB | {ours[2]:.0f} MB | {baseline:.2f} s | {manual_rss:.0f} MB | | "
                     f"{baseline / ours[0]:.2f}x | |")
        if same is not None:
            lines.append(f"|   target vs llama-quantize --imatrix: {'identical' if not same else same[:3]}; manual: "
                         f"convert {convert[0]:.1f} s, llama-imatrix {by_hand[0]:.1f} s, llama-quantize "
                         f"{quant[0]:.1f} s | | | | | | | | |")
        shutil.rmtree(out)
    ref_out.unlink()
    shutil.rmtree(calib.parent)
    return lines


TAGS = ("q4_k_m", "q6_k", "q8_0")


def tags_rows(work: Path, venv_bin: Path, target: Path, drafter: Path, inputs: list[Path], mb: float) -> list[str]:
    """Three quant tags, each with its drafter: one dflash-convert run of ``--quant Q4_K_M,Q6_K,Q8_0`` (the
    checkpoint read once, every tag written from that read) against three runs of one tag each; inputs warmed in the
    page cache before each run."""
    def run(out: Path, *quant: str) -> tuple[float, float, float]:
        for p in inputs:
            warm(p)
        return timed_disk([str(venv_bin / "dflash-convert"), "--target", str(target), "--drafter", str(drafter),
                           *quant, "--outdir", str(out)], out, cwd=work)

    alone = []
    for tag in TAGS:  # the drafter at the tag's type, as the run of three makes it
        alone.append(run(work / f"tag-{tag}", "--quant", tag, "--draft-quant", tag))
        shutil.rmtree(work / f"tag-{tag}")
    together = run(work / "tags", "--quant", ",".join(TAGS))
    shutil.rmtree(work / "tags")
    three = sum(r[0] for r in alone)
    return [f"| three tags ({', '.join(t.upper() for t in TAGS)}) with their drafters, one run ({mb:.0f} MB BF16 "
            f"in) | {together[0]:.2f} s | {together[1]:.0f} MB | {together[2]:.0f} MB | three runs of one tag: "
            f"{three:.2f} s | {max(r[1] for r in alone):.0f} MB | {max(r[2] for r in alone):.0f} MB | "
            f"{three / together[0]:.2f}x | |",
            f"|   one tag alone: {', '.join(f'{t.upper()} {r[0]:.1f} s' for t, r in zip(TAGS, alone, strict=True))} "
            "| | | | | | | | |"]



# --------------------------------------------------------------------- the 12B-shaped stand-in (--full)

GEMMA4_VOCAB = "ggml-vocab-gemma-4.gguf"  # b11434's models/ file: Gemma-4's real 262,144 tokens and 514,906 merges
_SPECIAL_TYPES = (3, 4)  # llama.cpp token types CONTROL, USER_DEFINED: special added tokens in tokenizer.json


def write_gemma4_vocab(model_dir: Path) -> int:
    """Replace the fixture's 512-token tokenizer with Gemma-4's real vocabulary, read from b11434's
    ``models/ggml-vocab-gemma-4.gguf``: tokenizer.json (BPE, byte fallback, as transformers' GemmaConverter
    writes it) and tokenizer_config.json's added tokens. Returns the vocabulary size."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    reader = GGUFReader(reference_env.llama_cpp_src() / "models" / GEMMA4_VOCAB)

    fields = reader.fields
    tokens, merges = ([bytes(fields[key].parts[i]).decode("utf-8") for i in fields[key].data]
                      for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    f = fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges],
                        unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    special = [i for i, t in enumerate(types) if t in _SPECIAL_TYPES]
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in special])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B:1",
                                                       special_tokens=[("<bos>", 2)])
    tok.save(str(model_dir / "tokenizer.json"))
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["added_tokens_decoder"] = {str(i): {"content": tokens[i], "lstrip": False, "normalized": False,
                                            "rstrip": False, "single_word": False, "special": True} for i in special}
    standard = {"<pad>", "<eos>", "<bos>", "<unk>", "<mask>"}
    cfg["additional_special_tokens"] = [tokens[i] for i in special if types[i] == 3 and tokens[i] not in standard]
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return len(tokens)


# Gemma-4-12B's text model (hf-checkpoint layout: text_config of google/gemma-4-12B-it).
G12 = dict(hidden=3840, layers=48, heads=16, head_dim=256, global_head_dim=512, kv_heads=8, global_kv_heads=1,
           ff=15360, vocab=262144)


def make_gemma4_12b_target(root: Path, *, layers: int = G12["layers"], n_shards: int = 5) -> tuple[Path, float]:
    """Gemma-4-12B-it's shapes (hidden 3840, 48 layers, 5 sliding : 1 full, head dims 256/512, k_eq_v full
    layers, FF 15360, tied) with its real 262,144-token vocabulary; random BF16 weights in ``n_shards``
    shards, ~23.8 GB at 48 layers. Returns (dir, MB of weights)."""
    d = fixtures.make_gemma4_target(root, name_suffix=f"-12b-{layers}l")
    for p in d.glob("model*.safetensors"):
        p.unlink()
    g = G12
    vocab = write_gemma4_vocab(d)
    types = ["full_attention" if i % 6 == 5 or i == layers - 1 else "sliding_attention" for i in range(layers)]
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"].update(hidden_size=g["hidden"], num_attention_heads=g["heads"], head_dim=g["head_dim"],
                              global_head_dim=g["global_head_dim"], num_key_value_heads=g["kv_heads"],
                              num_global_key_value_heads=g["global_kv_heads"], intermediate_size=g["ff"],
                              num_hidden_layers=layers, layer_types=types, vocab_size=vocab, sliding_window=1024)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d, _write_noise_checkpoint(d, _gemma4_shapes(g["hidden"], g["heads"], g["head_dim"], g["global_head_dim"],
                                                        g["kv_heads"], g["global_kv_heads"], g["ff"], vocab, types),
                                      n_shards=n_shards)


FULL_DISK_GB = 68  # inputs 25 GB + the manual workflow's BF16 target 24 GB + its Q4_0 and Q4_K_M targets + ours


def _same_tensor_data(ours: Path, ref: Path) -> list[str]:
    """Tensor names, types, shapes and data bytes of two multi-GB GGUFs, hashed one tensor at a time with
    ``pread`` (gguf_compare.read_tensors, or gguf-py's reader on a 262k vocabulary, holds far too much)."""
    import hashlib

    from dflash_gguf.ggufio.reader import read_gguf, tensor_nbytes

    def digest(path: Path) -> list[tuple[str, str, tuple[int, ...], str]]:
        meta, out = read_gguf(path), []
        with open(path, "rb", buffering=0) as f:
            for t in meta.tensors.values():
                h, left, pos = hashlib.sha256(), tensor_nbytes(t, path), meta.data_offset + t.offset
                while left:
                    chunk = os.pread(f.fileno(), min(left, 1 << 24), pos)
                    h.update(chunk)
                    left, pos = left - len(chunk), pos + len(chunk)
                out.append((t.name, t.type_name, t.ne, h.hexdigest()))
        return out

    a, b = digest(ours), digest(ref)
    if [x[0] for x in a] != [x[0] for x in b]:
        return ["tensor names or order differ"]
    return [f"{x[0]}: {x[1:3]} vs {y[1:3]}" + (" (data differ)" if x[3] != y[3] else "")
            for x, y in zip(a, b, strict=True) if x != y]


def drop_caches() -> bool:
    """Empty the page cache (root only), so each full-size step reads its input from the disk."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def full_rows(work: Path, venv_bin: Path, ref_py: str, llama_quantize: Path, layers: int = G12["layers"]
              ) -> list[str]:
    """The whole pipeline on a Gemma-4-12B-it-shaped target and a gemma4-12B-it-DFlash-shaped drafter, against
    the manual b11434 workflow and ``cat`` of the inputs (the physical limit), in one run."""
    need_gb = FULL_DISK_GB * (layers + 4) / (G12["layers"] + 4)  # the embedding weighs about four layers
    free_gb = shutil.disk_usage(work).free / 1e9
    print(f"--full: the 12B-shaped stand-in ({layers} layers) needs about {need_gb:.0f} GB of free disk in {work}; "
          f"{free_gb:.0f} GB are free.", flush=True)
    if free_gb < need_gb:
        raise SystemExit(f"Not enough disk for --full in {work} ({free_gb:.0f} GB free, about {need_gb:.0f} GB "
                         "needed). Pass --workdir on a larger disk, or fewer --full-layers.")
    target, t_mb = make_gemma4_12b_target(work / "ft", layers=layers)
    if layers < 6:
        raise SystemExit("--full-layers must be at least 6 (the drafter taps three distinct target layers)")
    taps = [1, 10, 19, 28, 37, 46] if layers == G12["layers"] else [1, layers // 2, layers - 2]
    drafter = make_pipeline_drafter(work / "fd", target, layers, h=G12["hidden"], ff=2 * G12["hidden"], taps=taps)
    inputs = [*sorted(target.glob("*.safetensors")), *drafter.glob("*.safetensors")]
    mb = t_mb + sum(p.stat().st_size for p in drafter.glob("*.safetensors")) / 1e6
    cold = drop_caches()
    cat_cmd = ["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, inputs)]
    cat = [timed(cat_cmd), timed(cat_cmd)]
    drop_caches()  # the disk itself: each piece dropped from the page cache once read, as the pipeline does
    disk = timed(["sh", "-c", 'for f; do dd if="$f" of=/dev/null bs=8M iflag=nocache status=none; done', "dd",
                  *map(str, inputs)])
    manual_dir, out = work / "manual", work / "pair"
    manual_dir.mkdir()
    t_bf16, d_bf16 = manual_dir / "target-BF16.gguf", manual_dir / "drafter-BF16.gguf"
    t_q4, t_q4km = manual_dir / "target-Q4_0.gguf", manual_dir / "target-Q4_K_M.gguf"
    steps = [[ref_py, str(reference_env.convert_script()), str(target), "--outfile", str(t_bf16)],
             [str(llama_quantize), str(t_bf16), str(t_q4), "Q4_0", "2"],
             [str(llama_quantize), str(t_bf16), str(t_q4km), "Q4_K_M", "2"],
             [ref_py, str(reference_env.convert_script()), str(drafter), "--target-model-dir", str(target),
              "--outfile", str(d_bf16)],
             [str(llama_quantize), str(d_bf16), str(manual_dir / "drafter-Q4_0.gguf"), "Q4_0", "2"]]
    manual_all = []
    drop_caches()
    for i, cmd in enumerate(steps):
        manual_all.append(timed_disk(cmd, manual_dir, cwd=work))
        if i == 2:  # the BF16 target is deleted once quantized, so the run fits the disk; a user keeps it
            t_bf16.unlink()
    manual = [manual_all[i] for i in (0, 1, 3, 4)]  # the Q4_0 pair's steps
    manual_km = [manual_all[i] for i in (0, 2, 3, 4)]  # the Q4_K_M target's
    m_wall, m_rss, m_disk = sum(r[0] for r in manual), max(r[1] for r in manual), max(r[2] for r in manual)
    km_wall, km_rss = sum(r[0] for r in manual_km), max(r[1] for r in manual_km)
    drop_caches()
    ours = timed_disk([str(venv_bin / "dflash-convert"), "--target", str(target), "--drafter", str(drafter),
                       "--quant", "q4_0", "--draft-quant", "q4_0", "--outdir", str(out)], out,
                      {"LLAMA_QUANTIZE": str(llama_quantize)}, cwd=work)  # found, and still not needed
    pair = json.loads((out / "pair.json").read_text())
    problems = [*_same_tensor_data(out / pair["outputs"]["target"]["file"], t_q4),
                *_same_tensor_data(out / pair["outputs"]["drafter"]["file"], manual_dir / "drafter-Q4_0.gguf")]
    shutil.rmtree(out)
    drop_caches()
    ours_km = timed_disk([str(venv_bin / "dflash-convert"), "--target", str(target), "--drafter", str(drafter),
                          "--quant", "q4_k_m", "--draft-quant", "q4_0", "--outdir", str(out)], out,
                         {"LLAMA_QUANTIZE": str(llama_quantize)}, cwd=work)
    pair = json.loads((out / "pair.json").read_text())
    problems_km = [*_same_tensor_data(out / pair["outputs"]["target"]["file"], t_q4km),
                   *_same_tensor_data(out / pair["outputs"]["drafter"]["file"],
                                      manual_dir / "drafter-Q4_0.gguf")]
    start = "an empty page cache" if cold else "whatever page cache the previous step left (no drop_caches here)"
    lines = [f"Each of cat, the manual workflow and dflash-convert starts from {start}.", "",
             "| 12B-shaped pair (local folders) | wall | peak RSS | peak disk | time / cat | speed-up |",
             "|---|---|---|---|---|---|",
             f"| cat of the {mb:.0f} MB BF16 input | {cat[0][0]:.1f} s | | | 1.00x | |",
             f"| cat again (partly cached: 24 GiB of RAM) | {cat[1][0]:.1f} s | | | | |",
             f"| dd iflag=nocache of the input (the disk, pages dropped once read) | {disk[0]:.1f} s | | | "
             f"{disk[0] / cat[0][0]:.2f}x | |",
             f"| dflash-convert --quant q4_0 --draft-quant q4_0 (built-in, one pass) | {ours[0]:.1f} s | "
             f"{ours[1]:.0f} MB | {ours[2]:.0f} MB | {ours[0] / cat[0][0]:.2f}x | {m_wall / ours[0]:.2f}x |",
             f"| manual b11434 workflow (4 steps) | {m_wall:.1f} s | {m_rss:.0f} MB | {m_disk:.0f} MB | "
             f"{m_wall / cat[0][0]:.2f}x | 1.00x |",
             f"|   manual steps: {', '.join(f'{r[0]:.1f} s ({r[1]:.0f} MB)' for r in manual)} (convert target, "
             "quantize target, convert drafter, quantize drafter) | | | | | |",
             f"|   Q4_0 target and drafter tensors identical to b11434 convert + llama-quantize: "
             f"{'yes' if not problems else problems[:3]} | | | | | |",
             f"| dflash-convert --quant q4_k_m --draft-quant q4_0 (built-in, one pass) | {ours_km[0]:.1f} s | "
             f"{ours_km[1]:.0f} MB | {ours_km[2]:.0f} MB | {ours_km[0] / cat[0][0]:.2f}x | "
             f"{km_wall / ours_km[0]:.2f}x |",
             f"| manual b11434 workflow, llama-quantize Q4_K_M for the target (4 steps) | {km_wall:.1f} s | "
             f"{km_rss:.0f} MB | | {km_wall / cat[0][0]:.2f}x | 1.00x |",
             f"|   Q4_K_M target and Q4_0 drafter tensors identical to b11434 convert + llama-quantize: "
             f"{'yes' if not problems_km else problems_km[:3]} | | | | | |"]
    shutil.rmtree(out)
    shutil.rmtree(manual_dir)
    shutil.rmtree(target)
    shutil.rmtree(drafter)
    return lines



def _hand_loop(server: Path, target: Path, configs: list[dict], n_requests: int, n_predict: int) -> float:
    """What a user does by hand for the same configurations: start llama-server, wait, send the requests
    (chat completions of the built-in prompts' first user turn, greedy, n_predict tokens), stop. Seconds."""
    import socket
    import time
    import urllib.request

    t0 = time.monotonic()
    for cfg in configs:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "LD_LIBRARY_PATH": str(server.parent), "GGML_NO_BACKTRACE": "1"}
        proc = subprocess.Popen([str(server), "-m", str(target), *cfg["server_args"], "-t", "1", "-c", "4096",
                                 "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.1)
            prompts = bench_prompts()
            for i in range(n_requests + 1):  # + the warm-up tune also sends
                body = json.dumps({"messages": prompts[i % len(prompts)]["messages"], "max_tokens": n_predict,
                                   "temperature": 0, "ignore_eos": True, "cache_prompt": False}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=600) as r:
                    r.read()
        finally:
            proc.terminate()
            proc.wait()
    return time.monotonic() - t0


def bench_prompts() -> list[dict]:
    """The built-in prompt set with the long-context prompt at 6 sections (it fits the fixture's 4096 context
    with its 512-piece vocabulary), as a prompt file both sides read."""
    from dflash_gguf.tune.workload import BUILTIN_PROMPTS, _long_context

    return [{"name": p.name, "messages": list(_long_context(6) if p.sections else p.messages)}
            for p in BUILTIN_PROMPTS]


def tune_rows(work: Path, venv_bin: Path, server: Path) -> list[str]:
    """dflash-gguf tune (quick and the default sweep) on the acceptance fixture vs the same work by hand."""
    fx = fixtures.make_acceptance_fixture(work / "acceptance")
    target, drafter = work / "acc-target-BF16.gguf", work / "dflash-acc-BF16.gguf"
    subprocess.run([str(venv_bin / "dflash-gguf"), "convert-target", str(fx.target), "--outfile", str(target)],
                   check=True, capture_output=True)
    subprocess.run([str(venv_bin / "dflash-convert"), "--drafter", str(fx.drafter), "--target", str(fx.target),
                    "--outfile", str(drafter)], check=True, capture_output=True)
    lines = ["| tune on the acceptance fixture (1 thread) | configurations | requests | dflash-gguf tune | peak RSS "
             "| in llama-server requests | same work by hand | speed-up |", "|---|---|---|---|---|---|---|---|"]
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps(bench_prompts()))
    for label, extra in (("--quick", ["--quick"]), ("default sweep", [])):
        out = work / f"tune{len(extra)}.json"
        cmd = [str(venv_bin / "dflash-gguf"), "tune", str(target), str(drafter), "--prompts", str(prompts), "--json",
               *extra, "--", "-t", "1"]
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True,
                              env={**os.environ, "LLAMA_SERVER": str(server)}, stdin=subprocess.DEVNULL)
        wall, rss = _time_v(cmd, proc)
        out.write_text(proc.stdout)
        doc = json.loads(proc.stdout)
        rows = [c for c in doc["configurations"] if c["status"] == "ok"]
        n_req = sum(c["requests"] for c in rows)
        inside = sum(c["request_seconds"] for c in rows)
        by_hand = _hand_loop(server, target, rows, rows[0]["requests"], doc["workload"]["n_predict"])
        lines.append(f"| {label} | {len(rows)} | {n_req} | {wall:.1f} s | {rss:.0f} MB | {inside:.1f} s | "
                     f"{by_hand:.1f} s | {by_hand / wall:.2f}x |")
        best = doc["best"]
        low = min(c["acceptance"] for c in rows if c["drafter"])
        lines.append(f"|   best: {best['label']} ({best['speedup']}x the target alone); lowest acceptance of a "
                     f"drafting configuration {low:.2f} | | | | | | | |")
    return lines


FORECAST_LAYERS, FORECAST_N_MAX = 12, 4


def forecast_rows(work: Path, venv_bin: Path, server: Path) -> list[str]:
    """``dflash-gguf forecast`` (stand-ins from the folders' configs and headers) against the real pair dflash-convert
    makes from the same folders, both measured by tune's engine with b11434's llama-server at ``--spec-synth-len L``,
    one run each, 2 threads: the forecast / real ratio per accepted length. The last column checks the step-time
    model ``tune`` places its measurements with (speed proportional to L at a fixed n-max), fitted at L = n-max + 1."""
    from dflash_gguf.tune import Configuration, TuneOptions, Workload, inspect_drafter, measure_configurations

    target, mb = make_big_qwen3_target(work / "forecast", FORECAST_LAYERS, tied=True)
    drafter = fixtures.make_drafter(work / "forecast" / "drafters", target="qwen3", hidden=2048,
                                    config_overrides={"num_target_layers": FORECAST_LAYERS})
    flags = ["-t", "2"]
    wl = Workload(n_predict=64, repeats=2)
    env = {**os.environ, "LLAMA_SERVER": str(server), "XDG_CACHE_HOME": str(work / "xdg")}
    cmd = [str(venv_bin / "dflash-gguf"), "forecast", "--target", str(target), "--drafter", str(drafter), "--quant",
           "Q4_0", "--n-max", str(FORECAST_N_MAX), "--n-predict", str(wl.n_predict), "--repeats", str(wl.repeats),
           "--json", "--", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if proc.returncode:
        raise SystemExit(f"forecast failed ({proc.returncode}): {proc.stderr[-2000:]}")
    doc = json.loads(proc.stdout)
    real = work / "forecast" / "real"
    subprocess.run([str(venv_bin / "dflash-convert"), "--target", str(target), "--drafter", str(drafter), "--quant",
                    "Q4_0", "--outdir", str(real)], check=True, capture_output=True, env=env)
    pair = json.loads((real / "pair.json").read_text())["outputs"]
    d = inspect_drafter(real / pair["drafter"]["file"])
    lengths = [float(v) for v in range(1, FORECAST_N_MAX + 2)]
    os.environ["LLAMA_SERVER"] = str(server)
    measured, info = measure_configurations(
        real / pair["target"]["file"], [Configuration(), *(Configuration(d, FORECAST_N_MAX, synth_len=v)
                                                           for v in lengths)],
        TuneOptions(workload=wl, user_flags=tuple(flags)))
    base = measured[0].gen_tps or 0.0
    real_up = {m.config.synth_len: (m.gen_tps or 0.0) / base for m in measured[1:]}
    [curve] = doc["configurations"]
    fc_up = {row["acceptance_length"]: row["speedup"] for row in curve["lengths"]}
    top = lengths[-1]
    lines = [f"| Qwen3-1.7B-shaped target, {FORECAST_LAYERS} layers ({mb:.0f} MB BF16) Q4_0 + DFlash Q8_0, n-max "
             f"{FORECAST_N_MAX}, -t 2 | forecast (stand-ins) | real pair | forecast / real | step-time model / real |",
             "|---|---|---|---|---|",
             f"| target alone | {doc['generation_tokens_per_second']:.1f} tokens/s | {base:.1f} tokens/s | "
             f"{doc['generation_tokens_per_second'] / base:.2f} | |"]
    for v in lengths:
        model = real_up[top] * v / top
        lines.append(f"| L = {v:g} | {fc_up[v]:.3f}x | {real_up[v]:.3f}x | {fc_up[v] / real_up[v]:.2f} | "
                     f"{model / real_up[v]:.2f} |")
    even = curve["break_even_acceptance_length"]
    lines.append(f"| break-even | {'never here' if even is None else f'L = {even:g}'} | | | |")
    lines.append(f"|   {wl.n_predict} tokens x {len(wl.prompts)} prompts x {wl.repeats} repeats; server {info.build}; "
                 f"{info.system_info} | | | | |")
    return lines


STREAM_RATE = 100e6  # bytes per second: the loopback Hub's link, every file together


def _disk(folders: list[Path]) -> int:
    """Bytes of the files under ``folders`` now (symlinks not followed; files removed meanwhile skipped)."""
    total = 0
    for folder in folders:
        for base, _, files in os.walk(folder):
            for name in files:
                try:
                    total += os.lstat(os.path.join(base, name)).st_size
                except OSError:
                    pass
    return total


@dataclass
class _HubRun:
    wall: float
    peak: int  # bytes of the Hub cache + the output folder, sampled
    end: int  # the same when it ended
    files: dict[str, str]  # the GGUFs made, by sha256
    streamed: dict[str, float]  # the run's own account of the stream (its --json "streamed")
    home: Path


def stream_rows(work: Path, venv_bin: Path) -> list[str]:
    """``dflash-convert --quant Q4_K_M`` from repo ids against a loopback Hub serving 100 MB/s in total (the tests' Hub
    server with its rate limit), a Qwen3-4B-shaped target in 10 shards cut in module order as save_pretrained cuts
    them, and its DFlash drafter: against
    ``snapshot_download`` of the same files at the same rate, and against downloading first then converting (the
    same command finding every shard in the Hub cache). Wall time, and peak disk of the Hub cache plus the output
    folder sampled every 20 ms; the three runs' files compared."""
    import threading
    import time

    from hub_server import FakeRepo, client_env, serve

    from dflash_gguf.pipeline.manifest import sha256_file

    target, mb = make_big_qwen3_target(work / "stream", 12, tied=True, hidden=2560, heads=32, ff=9728, n_shards=10,
                                       cut=True)
    drafter = fixtures.make_drafter(work / "stream" / "drafters", target="qwen3", hidden=2560,
                                    config_overrides={"num_target_layers": 12})
    t_repo, d_repo = "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"
    repos = {t_repo: FakeRepo({p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}),
             d_repo: FakeRepo({p.name: p.read_bytes() for p in drafter.iterdir() if p.is_file()})}
    shards = sorted(n for n in repos[t_repo].files if n.endswith(".safetensors"))
    largest = max(len(repos[t_repo].files[n]) for n in shards)
    total = sum(len(b) for r in repos.values() for b in r.files.values())

    def run(name: str, cmd: list[str], home: Path | None = None) -> _HubRun:
        home = home or work / name / "hf"
        out = work / name / "pair"
        peak, stop = 0, threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, _disk([home, out]))
                time.sleep(0.02)

        with serve(repos, rate=STREAM_RATE) as hub:
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            t0 = time.monotonic()
            proc = subprocess.run([*cmd, *(["--outdir", str(out)] if "dflash-convert" in cmd[0] else [])],
                                  env={**client_env(hub.url, home), "HF_HUB_DISABLE_TELEMETRY": "1"},
                                  capture_output=True, text=True, stdin=subprocess.DEVNULL)
            wall = time.monotonic() - t0
            stop.set()
            sampler.join()
        if proc.returncode:
            raise SystemExit(f"{name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        doc = json.loads(proc.stdout) if proc.stdout.startswith("{") else {}
        files = {p.name: sha256_file(p) for p in sorted(out.glob("*.gguf"))} if out.is_dir() else {}
        return _HubRun(wall, peak, _disk([home, out]), files, doc.get("streamed") or {}, home)

    convert = [str(venv_bin / "dflash-convert"), "--target", t_repo, "--drafter", d_repo, "--quant", "Q4_K_M",
               "--json"]
    fetch = [sys.executable, "-c", f"from huggingface_hub import snapshot_download as s; s({t_repo!r}); s({d_repo!r})"]
    dl = run("download", fetch)
    first = run("download", convert, home=dl.home)  # every shard in the Hub cache already: nothing streams
    streamed = run("streamed", convert)
    bounded = run("no-keep-source", [*convert, "--no-keep-source"])
    same = first.files == streamed.files == bounded.files
    lines = [f"| from repo ids at {STREAM_RATE / 1e6:.0f} MB/s: Qwen3-4B-shaped target ({mb:.0f} MB BF16, "
             f"{len(shards)} shards) + DFlash drafter, {total / 1e6:.0f} MB in all, to Q4_K_M + Q8_0 | wall | "
             "/ snapshot_download | peak disk (Hub cache + folder) | left on disk |", "|---|---|---|---|---|",
             f"| snapshot_download of the same files | {dl.wall:.1f} s | 1.00x | {dl.peak / 1e6:.0f} MB | "
             f"{dl.end / 1e6:.0f} MB |"]
    t_first = dl.wall + first.wall
    lines.append(f"| download, then dflash-convert (the run alone: {first.wall:.1f} s) | {t_first:.1f} s | "
                 f"{t_first / dl.wall:.2f}x | {max(dl.peak, first.peak) / 1e6:.0f} MB | {first.end / 1e6:.0f} MB |")
    for label, r in (("dflash-convert, streamed (shards kept in the Hub cache)", streamed),
                     ("dflash-convert --no-keep-source", bounded)):
        lines.append(f"| {label}: {r.streamed.get('waiting_on_network_seconds', 0):.1f} s of the target's "
                     f"{r.streamed.get('seconds', 0):.1f} s waiting on the network | {r.wall:.1f} s | "
                     f"{r.wall / dl.wall:.2f}x | {r.peak / 1e6:.0f} MB | {r.end / 1e6:.0f} MB |")
    outputs = sum(p.stat().st_size for p in (work / "no-keep-source" / "pair").glob("*.gguf"))
    lines.append(f"|   --no-keep-source bound: outputs {outputs / 1e6:.0f} MB + three largest shards "
                 f"{3 * largest / 1e6:.0f} MB = {(outputs + 3 * largest) / 1e6:.0f} MB; the three runs' files "
                 f"{'identical' if same else 'DIFFERENT'}; {os.cpu_count()} CPUs | | | | |")
    for name in ("stream", "download", "streamed", "no-keep-source"):
        shutil.rmtree(work / name, ignore_errors=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None,
                    help="the disk for the ~4.5 GB of files (default: tmp); they go in a fresh folder inside it, "
                    "removed at the end unless --keep")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--only-targets", action="store_true", help="run only the target conversion rows")
    ap.add_argument("--only-moe-targets", action="store_true",
                    help="run only the Qwen3-MoE, gpt-oss and MiniMax-M2 target conversion rows")
    ap.add_argument("--only-pipeline", action="store_true", help="run only the whole-pipeline rows")
    ap.add_argument("--only-tune", action="store_true", help="run only the tuner rows")
    ap.add_argument("--only-forecast", action="store_true",
                    help="run only the forecast-against-the-real-pair rows")
    ap.add_argument("--only-stream", action="store_true",
                    help="run only the from-the-Hub rows (convert while downloading, at 100 MB/s)")
    ap.add_argument("--only-kernels", action="store_true", help="run only the quantization kernel rows")
    ap.add_argument("--only-projector", action="store_true", help="run only the projector (mmproj) row")
    ap.add_argument("--only-kquant-disk", action="store_true",
                    help="run only the Q4_K_M one pass against cat on the 3.2 GB Qwen3-4B-shaped target")
    ap.add_argument("--full", action="store_true",
                    help=f"run only the 12B-shaped whole-pipeline rows (needs about {FULL_DISK_GB} GB of free disk)")
    ap.add_argument("--full-layers", type=int, default=G12["layers"],
                    help="target layers for --full (48 is Gemma-4-12B; fewer for a quick look)")
    args = ap.parse_args()
    if args.workdir:  # a fresh folder inside it: only what the bench made is removed at the end
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-", dir=args.workdir))
    venv_bin = Path(sys.executable).parent
    ref_py = str(reference_env.venv_python(reference_env.ref_venv_dir()))
    bins = reference_env.llama_bin_dir()
    from dflash_gguf.quantize.kernels import kernel_path

    print(f"built-in quantizer kernels: {kernel_path()}\n")
    try:
        if args.full:
            print("\n".join(full_rows(work, venv_bin, ref_py, bins / "llama-quantize", args.full_layers)))
            return
        if args.only_projector:
            print("\n".join(projector_rows(work, venv_bin, ref_py)))
            return
        if args.only_stream:
            print("\n".join(stream_rows(work, venv_bin)))
            return
        if args.only_kernels:
            print("\n".join(kernel_rows(work, venv_bin, bins / "llama-quantize")))
            return
        if args.only_kquant_disk:
            print("\n".join(kquant_disk_rows(work, venv_bin, ref_py, bins / "llama-quantize")))
            return
        if args.only_targets:
            print("\n".join(target_rows(work, venv_bin, ref_py)))
            return
        if args.only_moe_targets:
            print("\n".join(target_rows(work, venv_bin, ref_py, classic=False)))
            return
        if args.only_pipeline:
            print("\n".join(pipeline_rows(work, venv_bin, ref_py, bins / "llama-quantize")))
            return
        if args.only_tune:
            print("\n".join(tune_rows(work, venv_bin, bins / "llama-server")))
            return
        if args.only_forecast:
            print("\n".join(forecast_rows(work, venv_bin, bins / "llama-server")))
            return
        drafter, target = make_big_drafter(work)
        st = drafter / "model.safetensors"
        mb = st.stat().st_size / 1e6
        lines = ["| step | dflash-gguf | MB/s | peak RSS | llama.cpp b11434 | MB/s | peak RSS | speed-up | RSS ratio |",
                 "|---|---|---|---|---|---|---|---|---|"]
        warm(st)
        ours_out, ref_out = work / "ours-BF16.gguf", work / "ref-BF16.gguf"
        ours = timed([str(venv_bin / "dflash-convert"), "--drafter", str(drafter), "--target", str(target),
                      "--outfile", str(ours_out)])
        warm(st)
        ref = timed([ref_py, str(reference_env.convert_script()), str(drafter), "--target-model-dir", str(target),
                     "--outfile", str(ref_out)], cwd=work)
        lines.append(row(f"convert drafter ({mb:.0f} MB BF16)", mb, ours, ref))
        from gguf_compare import diff

        problems = diff(ours_out, ref_out)
        ref_out.unlink()
        lines += quantize_both(ours_out, "drafter", work, venv_bin / "dflash-gguf", bins / "llama-quantize")
        target = make_target_gguf(work / "target-BF16.gguf", None, hidden=2880, layers=14, ff=7680, vocab=32000)
        lines += quantize_both(target, "target (H 2880)", work, venv_bin / "dflash-gguf", bins / "llama-quantize")
        target.unlink()
        # rows a multiple of 256, as in nearly every released model: llama-quantize keeps output.weight in Q6_K
        target = make_target_gguf(work / "target-h3072-BF16.gguf", None, hidden=3072, layers=8, ff=8192,
                                  vocab=65536)
        lines += quantize_both(target, "target (H 3072, Q6_K output)", work, venv_bin / "dflash-gguf",
                               bins / "llama-quantize")
        target.unlink()
        big = make_target_gguf(work / "target-10G-BF16.gguf", ours_out, hidden=H, layers=48, ff=15360,
                               vocab=262144, sparse=True)
        v = timed([str(venv_bin / "dflash-verify"), str(ours_out), str(big), "--json"], ok_codes=(0, 1))
        lines.append(f"| verify drafter + {big.stat().st_size / 1e9:.1f} GB target (headers + sampled rows) | "
                     f"{v[0]:.2f} s | | {v[1]:.0f} MB | (no llama.cpp equivalent) | | | | |")
        lines += target_rows(work, venv_bin, ref_py)
        lines += projector_rows(work, venv_bin, ref_py)
        lines += ["", *pipeline_rows(work, venv_bin, ref_py, bins / "llama-quantize")]
        lines += ["", *tune_rows(work, venv_bin, bins / "llama-server")]
        lines += ["", *forecast_rows(work, venv_bin, bins / "llama-server")]
        lines += ["", *stream_rows(work, venv_bin)]
        lines += ["", *kernel_rows(work, venv_bin, bins / "llama-quantize")]
        lines += ["", *kquant_disk_rows(work, venv_bin, ref_py, bins / "llama-quantize")]
        print("\n".join(lines))
        print(f"\nconvert parity on the synthetic drafter: {'identical' if not problems else problems[:5]}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
