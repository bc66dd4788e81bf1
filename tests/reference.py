"""Test helpers that run the llama.cpp b11434 reference: converter, llama-quantize, libllama, llama-server.

Byte-for-byte parity can only be shown against the real b11434, so tests call it through these helpers.
Everything here imports with nothing installed; a test first asks ``reference_available()``,
``llama_cpp_available()`` or ``llama_cpp_src_available()`` and hands the answer to ``require_or_skip``.
That function is the ONE guard of the suite: every test that cannot run without something the machine
may lack goes through it. It skips locally but fails on CI (``CI=true``), where a missing reference
means a broken pipeline, not an optional extra. Tests that compare with the reference are also marked
``@pytest.mark.reference`` and append to ``conftest.REFERENCE_COMPARISONS``; conftest fails the run
when a marked test did not compare (see its docstring).

Locations come from ``scripts/reference_env.py`` (set it up with ``python scripts/reference_env.py setup``;
with ``DFLASH_GGUF_SETUP=1`` the availability checks run the setup themselves). Every subprocess has a
timeout; servers bind to 127.0.0.1 only; the converter runs with Hugging Face offline switches and a
dead proxy, so nothing here touches the network.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import inspect
import io
import json
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import wave
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import preloaded_converter
import process_tally
import ref_cache

ROOT = Path(__file__).resolve().parents[1]
SETUP_ENV = "DFLASH_GGUF_SETUP"


def _load_reference_env() -> ModuleType:
    """Import scripts/reference_env.py by path: scripts/ is not a package."""
    name = "dflash_reference_env"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "reference_env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


env = _load_reference_env()

# ------------------------------------------------------------------------------------ availability


def on_ci() -> bool:
    """True when ``CI`` is ``true`` (or ``1``): missing prerequisites are failures, not skips."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def require_or_skip(reason: str | None) -> None:
    """The suite's one guard: None passes; a reason skips the test locally and fails it on CI (``CI=true``).

    Every test that needs the llama.cpp reference (or another prerequisite a developer's machine may
    lack) calls this instead of ``pytest.skip``/``skipif``, so nothing can be skipped silently on CI.
    """
    import pytest

    if reason is None:
        return
    if on_ci():
        pytest.fail(f"required on CI (CI=true): {reason}", pytrace=False)
    pytest.skip(reason)


def _auto_setup(step: str) -> str | None:
    if os.environ.get(SETUP_ENV) != "1":
        return None
    try:
        {"sdist": env.ensure_sdist, "ref": env.ensure_reference_venv, "llama": env.ensure_llama_cpp}[step]()
    except env.SetupError as exc:
        return f"automatic reference setup failed: {exc}"
    return None


QWEN2_VOCAB = "ggml-vocab-qwen2.gguf"  # b11434's models/ file the Qwen fixtures take their vocabulary from


def llama_cpp_src_available() -> str | None:
    """None when the b11434 source tree (sdist) is set up, with the vocab files the fixtures read."""
    failure = _auto_setup("sdist") or env.step_status("sdist")
    if failure:
        return failure
    vocab = env.llama_cpp_src() / "models" / QWEN2_VOCAB
    return None if vocab.is_file() else f"{vocab} is missing from the llama.cpp {env.LLAMA_CPP_TAG} sdist"


def require_llama_cpp_src() -> Path:
    """The b11434 source tree, through the guard (skips locally, fails on CI when it is missing)."""
    require_or_skip(llama_cpp_src_available())
    return env.llama_cpp_src()


def reference_available() -> str | None:
    """None when b11434's convert_hf_to_gguf.py can run, else why not."""
    failure = _auto_setup("ref")
    return failure or env.step_status("ref") or env.step_status("sdist")  # ref's hint covers sdist


def llama_cpp_available() -> str | None:
    """None when the b11434 binaries and libllama are built, else why not."""
    failure = _auto_setup("llama")
    return failure or env.step_status("llama") or env.step_status("sdist")


def _require(reason: str | None) -> None:
    if reason is not None:
        raise FileNotFoundError(reason)


# --------------------------------------------------------------------------------------- converter


def _offline_env(tmp: Path) -> dict[str, str]:
    """Environment that keeps the reference converter off the network and away from user caches."""
    out = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "HF_TOKEN")}
    dead_proxy = "http://127.0.0.1:9"  # discard port: any HTTP(S) attempt fails at once
    out.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HOME": str(tmp / "hf-home"),
            "PYTHONNOUSERSITE": "1",
            "http_proxy": dead_proxy,
            "https_proxy": dead_proxy,
            "HTTP_PROXY": dead_proxy,
            "HTTPS_PROXY": dead_proxy,
            "no_proxy": "",
            "NO_PROXY": "",
        }
    )
    return out


class FixtureTargets(dict):
    """Fixture target folders by case name, made on first use under ``work`` by ``maker(work, llama_cpp_src=...,
    **cases[name])`` (their tokenizers come from the b11434 sdist)."""

    def __init__(self, work: Path, maker: Callable[..., Path], cases: Mapping[str, Mapping[str, object]]) -> None:
        super().__init__()
        self.work, self.maker, self.cases = work, maker, cases

    def __missing__(self, name: str) -> Path:
        self[name] = self.maker(self.work, llama_cpp_src=require_llama_cpp_src(), **self.cases[name])
        return self[name]


class ReferenceConversions(dict):
    """b11434's ``convert_hf_to_gguf.py`` output per (case name, outtype) of ``targets``, converted once, into
    ``work``."""

    def __init__(self, work: Path, targets: Mapping[str, Path]) -> None:
        super().__init__()
        self.work, self.targets = work, targets

    def __missing__(self, key: tuple[str, str]) -> Path:
        name, outtype = key
        out = self.work / f"{name}-{outtype}.gguf"
        proc = run_reference_convert(self.targets[name], None, out, outtype)
        assert proc.returncode == 0, proc.stderr[-3000:]
        self[key] = out
        return out


def run_reference_convert(
    drafter_dir: str | os.PathLike[str],
    target_dir: str | os.PathLike[str] | None,
    outfile: str | os.PathLike[str],
    outtype: str = "auto",
    extra_args: Sequence[str] = (),
    timeout: float = 900,
) -> subprocess.CompletedProcess[str]:
    """Convert a drafter with b11434's convert_hf_to_gguf.py; output is captured, not checked.

    `target_dir` None omits --target-model-dir, which converts a plain (target) model instead.

    Raises:
        FileNotFoundError: the reference is not set up.
        subprocess.TimeoutExpired: the converter ran longer than `timeout`.
    """
    _require(reference_available())
    inputs = {"drafter": Path(drafter_dir), **({"target": Path(target_dir)} if target_dir is not None else {})}
    outputs = {"outfile": Path(outfile)}

    def cmd_for(paths: Mapping[str, Path]) -> list[str]:
        return [
            str(env.venv_python(env.ref_venv_dir())),
            str(env.convert_script()),
            str(paths["drafter"]),
            *(["--target-model-dir", str(paths["target"])] if "target" in paths else []),
            "--outfile",
            str(paths["outfile"]),
            "--outtype",
            outtype,
            *extra_args,
        ]

    cmd = cmd_for({**{k: p.resolve() for k, p in inputs.items()}, **{k: p.resolve() for k, p in outputs.items()}})
    # cwd is a scratch dir so nothing the script writes relative to cwd lands in the repo.
    with tempfile.TemporaryDirectory(prefix="dflash-ref-convert-") as tmp:
        run = ref_cache.cached_run(
            "reference converter",
            root=ref_cache_root(),
            identity=_converter_identity(),
            harness=_harness_source(cmd_for, _offline_env, _convert, preloaded_converter),
            args=[outtype, *extra_args],
            inputs=inputs,
            outputs=outputs,
            scratch={"cwd": Path(tmp)},
            run=lambda: _convert(cmd, Path(tmp), timeout),
        )
    return subprocess.CompletedProcess(cmd, run.returncode, run.stdout, run.stderr)


_preloaded: preloaded_converter.PreloadedConverter | None = None


def _convert(cmd: Sequence[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run the converter command ``cmd`` (python, script, arguments) in ``cwd``: a fork of this test process's
    preloaded converter (started on first use), or a process of its own under ``DFLASH_GGUF_REF_CONVERTER=process``."""
    global _preloaded
    if not preloaded_converter.preloaded_enabled():
        return subprocess.run(cmd, cwd=cwd, env=_offline_env(cwd), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    if _preloaded is None or not _preloaded.alive():
        server_home = Path(tempfile.mkdtemp(prefix="dflash-ref-converter-"))
        _preloaded = preloaded_converter.PreloadedConverter(Path(cmd[0]), Path(cmd[1]), _offline_env(server_home))
        atexit.register(_preloaded.close)
        atexit.register(shutil.rmtree, server_home, True)
    start = time.monotonic()
    try:
        return _preloaded.run(cmd[2:], cwd, _offline_env(cwd), timeout)
    finally:
        process_tally.record("reference converter", time.monotonic() - start)


# ------------------------------------------------------------------------------ reference identities


def ref_cache_root() -> Path:
    """Where reference results are kept: the reference cache folder (a test points it elsewhere)."""
    return env.cache_root()


def _harness_source(*objects: object) -> str:
    """The code that starts a reference run, for the cache key: a changed harness is a new key."""
    return "\n".join(_source(getattr(obj, "__code__", obj)) if callable(obj) or isinstance(obj, ModuleType)
                     else str(obj) for obj in objects)


@functools.cache
def _source(obj: object) -> str:
    """A function's source by its code object (a nested helper is a new function each call), read once."""
    return inspect.getsource(obj)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=1)
def _converter_identity() -> str:
    """b11434's converter as built here: the script, its gguf-py and the venv's marker (its pinned packages)."""
    src = env.llama_cpp_src()
    return ref_cache.files_identity([env.convert_script(), src / "gguf-py", env.ref_venv_dir() / env.MARKER])


@functools.cache
def _binaries_identity(program: str | None) -> str:
    """The compiled b11434 build a run uses: the program (None for a library user) and every shared library in
    its bin folder, by content, with the build's marker (its CMake arguments and CPU)."""
    bin_dir = env.llama_bin_dir()
    libs = [p for p in bin_dir.iterdir() if p.is_file() and p.name.startswith("lib")]
    program_files = [bin_dir / program] if program else []
    return ref_cache.files_identity([*program_files, *libs, env.llama_venv_dir() / env.MARKER])


# ------------------------------------------------------------------------------------ binaries


def llama_server_env() -> dict[str, str]:
    """This process's environment with b11434's llama-server for tune and ``--tune`` (and no llama-quantize)."""
    return {**os.environ, "LLAMA_SERVER": str(llama_bin("llama-server")), "LLAMA_QUANTIZE": ""}


def llama_bin(name: str) -> Path:
    """Path of a b11434 binary or library ("llama-quantize", "llama-server", "libllama.so", ...).

    Raises:
        FileNotFoundError: the build is missing, or has no file of that name.
    """
    _require(llama_cpp_available())
    env.fix_llama_symlinks()
    path = env.llama_bin_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist in the llama.cpp {env.LLAMA_CPP_TAG} build")
    return path


def _bin_env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}  # no hidden CLI args
    out.setdefault("GGML_NO_BACKTRACE", "1")  # an abort would otherwise attach gdb to print a backtrace
    libdir = str(env.llama_bin_dir())
    out["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)
    return out


def noting_binary(folder: Path, name: str) -> tuple[Path, Path, dict[str, str]]:
    """b11434's ``name`` behind a wrapper that notes each start's arguments, one line a run, before running it: the
    wrapper, the notes file, and the environment (its library path) it needs; point the tool's variable at it."""
    notes = folder / f"{name}-runs.txt"
    notes.touch()
    wrapper = folder / name
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{notes}"\nexec "{llama_bin(name)}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, notes, {"LD_LIBRARY_PATH": _bin_env()["LD_LIBRARY_PATH"]}


def run_llama_quantize(
    inp: str | os.PathLike[str],
    out: str | os.PathLike[str],
    qtype: str,
    *args: str,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run `llama-quantize [args] inp out qtype`; options go first because it stops parsing at inp."""
    cmd = [str(llama_bin("llama-quantize")), *args, str(inp), str(out), qtype]
    run = ref_cache.cached_run(
        "llama-quantize",
        root=ref_cache_root(),
        identity=_binaries_identity("llama-quantize"),
        harness=_harness_source(run_llama_quantize, _bin_env),
        args=[*args, qtype],
        inputs={"input": Path(inp)},
        outputs={"output": Path(out)},
        run=lambda: subprocess.run(
            cmd, env=_bin_env(), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        ),
    )
    return subprocess.CompletedProcess(cmd, run.returncode, run.stdout, run.stderr)


def run_mtmd_cli(model: str | os.PathLike[str], mmproj: str | os.PathLike[str],
                 timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``llama-mtmd-cli -m model --mmproj mmproj`` for one greedy token of a text prompt: libmtmd loads the projector
    (clip's hparams, every tensor) and runs its warmup graph(s) on dummy inputs before the prompt is decoded."""
    cmd = [str(llama_bin("llama-mtmd-cli")), "-m", str(model), "--mmproj", str(mmproj), "-p", "hello", "-n", "1",
           "--temp", "0", "--jinja", "-t", "1"]
    run = ref_cache.cached_run(
        "llama-mtmd-cli",
        root=ref_cache_root(),
        identity=_binaries_identity("llama-mtmd-cli"),
        harness=_harness_source(run_mtmd_cli, _bin_env),
        args=cmd[5:],
        inputs={"model": Path(model), "mmproj": Path(mmproj)},
        outputs={},
        run=lambda: subprocess.run(
            cmd, env=_bin_env(), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        ),
    )
    return subprocess.CompletedProcess(cmd, run.returncode, run.stdout, run.stderr)


# ----------------------------------------------------------------------------- libggml-base's quantizers

# Runs in a child process: a GGML_ASSERT in the library aborts the process, and must not take pytest with it.
_GGML_QUANTIZE_CHILD = r"""
import ctypes, json, sys
import numpy as np
cfg = json.loads(sys.argv[1])
lib = ctypes.CDLL(cfg["lib"])
x = np.fromfile(cfg["inp"], dtype=np.float32)
w = np.fromfile(cfg["weights"], dtype=np.float32) if cfg.get("weights") else None
chunk = lib.ggml_quantize_chunk
chunk.restype = ctypes.c_size_t
chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p]
for job in cfg["jobs"]:
    out = np.zeros(x.size // job["block"] * job["type_size"], np.uint8)
    if job["n_per_row"]:
        size = chunk(job["type"], x.ctypes.data, out.ctypes.data, 0, x.size // job["n_per_row"], job["n_per_row"],
                     w.ctypes.data if w is not None else None)
        assert size == out.size, size
    else:
        fn = getattr(lib, "quantize_row_" + job["name"] + "_ref")
        fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn(x.ctypes.data, out.ctypes.data, x.size)
    out.tofile(job["out"])
print("ok", flush=True)
"""


def ggml_quantize(x: Any, jobs: Sequence[tuple[Any, int | None]], tmp: Path, weights: Any = None) -> list[Any]:
    """b11434's libggml-base bytes for the float32 values ``x``, one array of blocks (n x type size, uint8) per
    job. A job is (``GGMLQuantizationType``, None) for ``quantize_row_<type>_ref``, or (type, n_per_row) for
    ``ggml_quantize_chunk`` over rows of that length, which is what llama-quantize calls: with ``weights`` (float32,
    one per column) as its importance matrix for every row, else without one."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES

    inp = tmp / "ggml-in.f32"
    np.ascontiguousarray(x, np.float32).tofile(inp)
    specs = [{"type": int(qtype), "name": qtype.name.lower().replace("_k", "_K"),  # ggml's names: q4_K, mxfp4
              "n_per_row": n_per_row, "out": str(tmp / f"ggml-{i}.q"),
              "block": GGML_QUANT_SIZES[qtype][0], "type_size": GGML_QUANT_SIZES[qtype][1]}
             for i, (qtype, n_per_row) in enumerate(jobs)]
    cfg = {"lib": str(llama_bin("libggml-base.so")), "inp": str(inp), "jobs": specs, "weights": None}
    if weights is not None:
        cfg["weights"] = str(tmp / "ggml-weights.f32")
        np.ascontiguousarray(weights, np.float32).tofile(cfg["weights"])
    res = subprocess.run([sys.executable, "-c", _GGML_QUANTIZE_CHILD, json.dumps(cfg)], env=_bin_env(),
                         capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert res.returncode == 0 and "ok" in res.stdout, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    return [np.fromfile(spec["out"], np.uint8).reshape(-1, spec["type_size"]) for spec in specs]


# ----------------------------------------------------------------------------- libllama via ctypes

# struct llama_model_params in b11434's include/llama.h, in declaration order. It is passed and
# returned BY VALUE, so the size must be exact; `model_params_layout()` measures the real layout with
# the C compiler and the tests check this mirror against it.
MODEL_PARAMS_FIELDS: tuple[tuple[str, type], ...] = (
    ("devices", ctypes.c_void_p),
    ("tensor_buft_overrides", ctypes.c_void_p),
    ("n_gpu_layers", ctypes.c_int32),
    ("split_mode", ctypes.c_int),
    ("load_mode", ctypes.c_int),
    ("lazy_mode", ctypes.c_int),
    ("main_gpu", ctypes.c_int32),
    ("tensor_split", ctypes.c_void_p),
    ("progress_callback", ctypes.c_void_p),
    ("progress_callback_user_data", ctypes.c_void_p),
    ("kv_overrides", ctypes.c_void_p),
    ("vocab_only", ctypes.c_bool),
    ("check_tensors", ctypes.c_bool),
    ("use_extra_bufts", ctypes.c_bool),
    ("no_host", ctypes.c_bool),
    ("no_alloc", ctypes.c_bool),
    ("load_mtp", ctypes.c_bool),
)
LLAMA_LOAD_MODE_MMAP = 1  # enum llama_load_mode in llama.h; b11434 replaced `bool use_mmap` by it


class ModelParamsMirror(ctypes.Structure):
    _fields_ = list(MODEL_PARAMS_FIELDS)


def mirror_layout() -> dict[str, object]:
    """The layout ctypes derives from MODEL_PARAMS_FIELDS, in the same shape as the compiler's."""
    return {
        "sizeof": ctypes.sizeof(ModelParamsMirror),
        "alignof": ctypes.alignment(ModelParamsMirror),
        "offsets": {name: getattr(ModelParamsMirror, name).offset for name, _ in MODEL_PARAMS_FIELDS},
        "LLAMA_LOAD_MODE_MMAP": LLAMA_LOAD_MODE_MMAP,
        "source": "ctypes mirror",
    }


_PROBE_C = """\
#include <stddef.h>
#include <stdio.h>
#include "llama.h"
typedef struct llama_model_params P;
int main(void) {
    printf("{\\"sizeof\\": %zu, \\"alignof\\": %zu, ", sizeof(P), _Alignof(P));
    printf("\\"LLAMA_LOAD_MODE_MMAP\\": %d, \\"offsets\\": {", (int) LLAMA_LOAD_MODE_MMAP);
FIELDS
    printf("}}\\n");
    return 0;
}
"""


def model_params_layout(compiler: str | None = None) -> dict[str, object]:
    """sizeof/offsetof of struct llama_model_params as the C compiler sees b11434's llama.h.

    Compiling against the header beats counting by hand: a field added in another build cannot
    silently shift the by-value struct. The result is cached per header hash under the cache root.
    Falls back to the ctypes mirror when no compiler or header is available.
    """
    cc = compiler or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    header = env.llama_cpp_src() / "include" / "llama.h"
    if cc is None or not header.is_file():
        return mirror_layout()
    fields = "\n".join(
        f'    printf("{", " if i else ""}\\"{name}\\": %zu", offsetof(P, {name}));'
        for i, (name, _) in enumerate(MODEL_PARAMS_FIELDS)
    )
    source = _PROBE_C.replace("FIELDS", fields)
    digest = hashlib.sha256(header.read_bytes() + source.encode()).hexdigest()[:16]
    cache = env.cache_root() / "abi" / f"llama_model_params-{digest}.json"
    with contextlib.suppress(OSError, ValueError):
        return json.loads(cache.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory(prefix="dflash-abi-") as tmp:
        (Path(tmp) / "probe.c").write_text(source, encoding="utf-8")
        include = [f"-I{env.llama_cpp_src() / 'include'}", f"-I{env.llama_cpp_src() / 'ggml' / 'include'}"]
        subprocess.run(
            [cc, "-std=gnu11", *include, "probe.c", "-o", "probe"],
            cwd=tmp,
            check=True,
            capture_output=True,
            timeout=120,
        )
        out = subprocess.run([str(Path(tmp) / "probe")], check=True, capture_output=True, text=True, timeout=30).stdout
    layout = json.loads(out)
    layout["source"] = f"{cc} against {header}"
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(layout, indent=2), encoding="utf-8")
    return layout


# Runs in a child process: an abort inside llama.cpp (GGML_ASSERT) must not take pytest down. The struct
# is an opaque, correctly sized and aligned blob; only the fields we set are written, at the offsets the
# compiler reported, so no field we do not touch can be misplaced.
_LOADER = r"""
import ctypes, json, sys
cfg = json.loads(sys.argv[1])
lay = cfg["layout"]
assert lay["sizeof"] % 8 == 0 and lay["alignof"] == 8, lay
class Params(ctypes.Structure):
    _fields_ = [("blob", ctypes.c_uint64 * (lay["sizeof"] // 8))]
lib = ctypes.CDLL(cfg["lib"])
lib.llama_backend_init.restype = None
lib.llama_model_default_params.restype = Params
lib.llama_model_default_params.argtypes = []
lib.llama_model_load_from_file.restype = ctypes.c_void_p
lib.llama_model_load_from_file.argtypes = [ctypes.c_char_p, Params]
lib.llama_model_free.restype = None
lib.llama_model_free.argtypes = [ctypes.c_void_p]
lib.llama_model_desc.restype = ctypes.c_int32
lib.llama_model_desc.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
lib.llama_model_n_params.restype = ctypes.c_uint64
lib.llama_model_n_params.argtypes = [ctypes.c_void_p]
lib.llama_backend_free.restype = None
lib.llama_backend_init()
p = lib.llama_model_default_params()
off = lay["offsets"]
ctypes.c_int32.from_buffer(p, off["n_gpu_layers"]).value = 0
ctypes.c_int.from_buffer(p, off["load_mode"]).value = lay["LLAMA_LOAD_MODE_MMAP"]
ctypes.c_bool.from_buffer(p, off["vocab_only"]).value = False
model = lib.llama_model_load_from_file(cfg["model"].encode(), p)
result = {"loaded": bool(model)}
if model:
    buf = ctypes.create_string_buffer(256)
    lib.llama_model_desc(model, buf, len(buf))
    result.update(desc=buf.value.decode(errors="replace"), n_params=lib.llama_model_n_params(model))
    lib.llama_model_free(model)
lib.llama_backend_free()
sys.stderr.flush()
print("DFLASH_LOADER_RESULT " + json.dumps(result), flush=True)
"""


def load_with_libllama(gguf_path: str | os.PathLike[str], timeout: float = 300) -> tuple[bool, str]:
    """Load a GGUF the way llama.cpp does (llama_model_load_from_file, CPU, mmap) in a child process.

    Returns (loaded, log): the log is llama.cpp's own stderr, so tests can assert on its exact error
    ("missing tensor 'x'", "wrong number of tensors; expected 11, got 12", ...). A crash or timeout is
    reported as not loaded, with the reason appended to the log.

    Raises:
        FileNotFoundError: the llama.cpp build is missing.
    """
    lib = llama_bin("libllama.so")
    layout = model_params_layout()
    cfg = {"lib": str(lib), "model": str(Path(gguf_path).resolve()), "layout": layout}
    try:
        res = ref_cache.cached_run(
            "libllama loader",
            root=ref_cache_root(),
            identity=_binaries_identity(None),
            harness=_harness_source(load_with_libllama, _LOADER, _bin_env, sys.executable),
            args=[json.dumps(layout, sort_keys=True)],
            inputs={"model": Path(gguf_path)},
            outputs={},
            run=lambda: subprocess.run(
                [sys.executable, "-c", _LOADER, json.dumps(cfg)],
                env=_bin_env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            ),
        )
    except subprocess.TimeoutExpired as exc:
        partial = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return False, f"{partial}\n[loader] timed out after {timeout}s"
    result: dict[str, object] = {}
    other_stdout = []
    for line in res.stdout.splitlines():
        if line.startswith("DFLASH_LOADER_RESULT "):
            result = json.loads(line.split(" ", 1)[1])
        else:
            other_stdout.append(line)
    log = res.stderr + "".join(f"{line}\n" for line in other_stdout)
    if not result:
        log += f"[loader] child exited with code {res.returncode} before reporting\n"
    elif result.get("loaded"):
        log += f"[loader] loaded: {result.get('desc')} ({result.get('n_params')} params)\n"
    return bool(result.get("loaded")) and res.returncode == 0, log


# ------------------------------------------------------------------------------------------ server


def free_port() -> int:
    """A currently free loopback port (the tiny race with other processes is acceptable in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never via a proxy


def http_json(url: str, payload: Mapping[str, object] | None = None, timeout: float = 120) -> tuple[int, object]:
    """GET (payload None) or POST JSON to a local server; returns (status, decoded body or text)."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with _NO_PROXY.open(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


@dataclass
class LlamaServer:
    """A running (or failed) llama-server; `output` holds its stdout+stderr, also after it exited."""

    url: str
    cmd: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    ready: bool = False
    returncode: int | None = None
    _final_output: str | None = field(default=None, repr=False)

    @property
    def output(self) -> str:
        if self._final_output is not None:
            return self._final_output
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_exit(self, timeout: float = 30) -> int | None:
        """Wait for the process to end on its own (e.g. an abort on the first request)."""
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.returncode = self.process.wait(timeout=timeout)
        return self.returncode


@contextlib.contextmanager
def start_llama_server(
    target: str | os.PathLike[str],
    draft: str | os.PathLike[str] | None,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    n_max: int = 15,
    startup_timeout: float = 180,
    spec_type: str = "draft-dflash",
) -> Iterator[LlamaServer]:
    """Run llama-server on 127.0.0.1 with the DFlash drafter; yield once /health answers or it died.

    ``spec_type``: the --spec-type given with the drafter (``draft-dspark`` for a DSpark drafter).

    The yielded LlamaServer has `ready` False when the process exited (or never became healthy)
    during startup: assert on `server.output` then, it holds llama.cpp's abort message. The process
    is killed on exit of the block; `output` stays readable afterwards.
    """
    port = port or free_port()
    cmd = [str(llama_bin("llama-server")), "-m", str(target)]
    if draft is not None:
        cmd += ["-md", str(draft), "--spec-type", spec_type, "--spec-draft-n-max", str(n_max)]
    # One thread: under pytest-xdist another worker shares the cores, and llama.cpp's second thread would spin at
    # every barrier while the first waits for a core (tests assert what the server does, never its speed).
    cmd += ["-c", "256", "-t", "1", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    with tempfile.TemporaryDirectory(prefix="dflash-llama-server-") as tmp:
        server = LlamaServer(url=f"http://127.0.0.1:{port}", cmd=cmd, log_path=Path(tmp) / "server.log")
        with open(server.log_path, "wb") as log_file:
            server.process = subprocess.Popen(
                cmd,
                cwd=tmp,
                env=_bin_env(),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            deadline = time.monotonic() + startup_timeout
            while time.monotonic() < deadline:
                if server.process.poll() is not None:
                    server.returncode = server.process.returncode
                    break
                with contextlib.suppress(OSError, urllib.error.URLError):
                    status, _ = http_json(f"{server.url}/health", timeout=2)
                    if status == 200:
                        server.ready = True
                        break
                time.sleep(0.2)
            yield server
        finally:
            if server.process.poll() is None:
                server.process.terminate()
                try:
                    server.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    server.process.kill()
                    server.process.wait(timeout=15)
            server.returncode = server.process.returncode
            server._final_output = server.log_path.read_text(encoding="utf-8", errors="replace")


def assert_one_pass_parity(model: Path, reference_bf16: Path, quant: str, work: Path) -> Path:
    """The built-in converter's one pass to ``quant`` writes the file llama-quantize makes of b11434's BF16
    conversion (``reference_bf16``); returns ours."""
    from gguf_compare import diff

    from dflash_gguf.convert.targets import convert_target

    ref, ours = work / "ref.gguf", work / "ours.gguf"
    proc = run_llama_quantize(reference_bf16, ref, quant)
    assert proc.returncode == 0, proc.stderr[-3000:]
    convert_target(model, ours, "bf16", quant=quant.lower())
    assert diff(ours, ref) == []
    return ours


def assert_libllama_loads_target(model: Path, outtype: str, work: Path) -> None:
    """libllama b11434 loads the built-in converter's file of ``model`` at ``outtype`` (q4_0: the one pass)."""
    from dflash_gguf.convert.targets import convert_target

    out = work / "ours.gguf"
    if outtype == "q4_0":
        convert_target(model, out, "bf16", quant="q4_0")
    else:
        convert_target(model, out, outtype)
    loaded, log = load_with_libllama(out)
    assert loaded, log[-3000:]


def assert_drafter_parity(drafter: Path, target: Path, work: Path, outtype: str = "auto") -> Path:
    """Our drafter converter and b11434's (``--target-model-dir``) write the same file; returns ours."""
    from gguf_compare import diff

    from dflash_gguf.drafters import convert_drafter

    ours, ref = work / f"drafter-ours-{outtype}.gguf", work / f"drafter-ref-{outtype}.gguf"
    convert_drafter(drafter, target, ours, outtype)
    proc = run_reference_convert(drafter, target, ref, outtype)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert diff(ours, ref) == []
    return ours


def serve_with_and_without_drafter(target: Path, drafter: Path, n_predict: int = 8, n_max: int = 9) -> str:
    """Serve ``target`` alone, then with ``drafter``; both answer ``n_predict`` greedy tokens, the drafter drafts
    (``draft_n`` > 0) and the text is the same, since greedy speculative decoding must not change it. Returns the
    server's output with the drafter, for the caller's own checks."""
    request = {"prompt": "hello world", "n_predict": n_predict, "temperature": 0, "top_k": 1}
    texts, output = [], ""
    for draft in (None, drafter):
        with start_llama_server(target, draft, n_max=n_max) as server:
            assert server.ready, server.output[-3000:]
            status, body = http_json(server.url + "/completion", request)
        assert status == 200 and isinstance(body, dict) and body["tokens_predicted"] == n_predict, body
        texts.append(body["content"])
        if draft is not None:
            assert body["timings"]["draft_n"] > 0, body["timings"]  # the drafter ran (random weights: few accepted)
            output = server.output
    assert texts[0] == texts[1], texts
    return output


# ------------------------------------------------------------------------------------------ media


def png_bytes(width: int = 32, height: int = 32) -> bytes:
    """An RGB PNG of colour gradients, written with zlib and struct: a real image for libmtmd's decoder (stb_image)
    with no imaging library in the tests."""
    rows = b"".join(b"\x00" + bytes(c for x in range(width) for c in (x * 255 // max(1, width - 1),
                                                                     y * 255 // max(1, height - 1), (x ^ y) * 8 % 256))
                    for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def wav_bytes(seconds: float = 0.5, rate: int = 16000) -> bytes:
    """A 16-bit mono WAV of a 440 Hz tone at the 16 kHz the Gemma-4 audio towers read (the wave module)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / rate)))
                               for i in range(int(seconds * rate))))
    return buf.getvalue()


def media_chat(text: str, media: str | None = None, max_tokens: int = 8, model: str | None = None) -> dict[str, Any]:
    """An OpenAI ``/v1/chat/completions`` body, greedy: one user turn of ``text`` and, for ``media`` "image" or
    "audio", a generated PNG (``image_url`` data URL) or WAV (``input_audio``) after it."""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if media == "image":
        url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
        content.append({"type": "image_url", "image_url": {"url": url}})
    elif media == "audio":
        content.append({"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes()).decode(),
                                                               "format": "wav"}})
    elif media is not None:
        raise ValueError(f"media {media!r}: 'image' or 'audio'")
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                            "temperature": 0, "top_k": 1, "seed": 0}
    return body | ({"model": model} if model else {})


def chat_with_and_without_drafter(target: Path, mmproj: Path, drafter: Path, requests: Mapping[str, Mapping[str, Any]],
                                  n_max: int = 9) -> tuple[dict[str, dict], dict[str, dict], str]:
    """Serve ``target`` with its projector (``--mmproj``) alone, then with ``drafter``; send every request of
    ``requests`` (name -> chat body) to ``/v1/chat/completions`` on both. Returns (answers alone, answers with the
    drafter, the log with the drafter); each answer must be HTTP 200."""
    answers: list[dict[str, dict]] = []
    output = ""
    for draft in (None, drafter):
        got: dict[str, dict] = {}
        with start_llama_server(target, draft, n_max=n_max, extra_args=["--mmproj", str(mmproj)]) as server:
            assert server.ready, server.output[-3000:]
            for name, request in requests.items():
                status, body = http_json(server.url + "/v1/chat/completions", request)
                assert status == 200 and isinstance(body, dict), (name, status, body, server.output[-3000:])
                got[name] = body
        answers.append(got)
        output = server.output
    return answers[0], answers[1], output


# ------------------------------------------------------------------------------------ tiny fixtures

TINY_VOCAB = "ggml-vocab-llama-spm.gguf"  # 32k SPM vocab shipped in b11434's models/ folder
TINY_HEADS = 2


@functools.lru_cache(maxsize=1)
def _tiny_vocab() -> tuple[list[bytes], list[float], list[int]]:
    """Tokens, scores and token types of TINY_VOCAB: a real vocab llama.cpp's SPM loader accepts."""
    import gguf

    fields = gguf.GGUFReader(env.llama_cpp_src() / "models" / TINY_VOCAB).fields
    tok = fields["tokenizer.ggml.tokens"]
    tokens = [bytes(tok.parts[i]) for i in tok.data]  # raw bytes: no decode/encode round trip
    scores = [float(s) for s in fields["tokenizer.ggml.scores"].contents()]
    types = [int(t) for t in fields["tokenizer.ggml.token_type"].contents()]
    return tokens, scores, types


def _write_tiny(
    path: str | os.PathLike[str],
    arch: str,
    hparams: Mapping[str, tuple[str, object]],
    tensors: Mapping[str, object],
    *,
    drop_tensors: Sequence[str],
    extra_tensors: Sequence[str],
    drop_keys: Sequence[str],
    mask_token_id: int | None = None,
) -> Path:
    """Write `{arch}.*` hparams, the tiny vocab and `tensors` (with the knobs applied) via gguf-py."""
    import gguf
    import numpy as np

    tensors = dict(tensors)
    n_embd = int(hparams["embedding_length"][1])  # type: ignore[call-overload]
    for name in extra_tensors:
        tensors[name] = np.ones(n_embd, dtype=np.float32)
    for name in drop_tensors:
        del tensors[name]
    tokens, scores, types = _tiny_vocab()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    for key, (kind, value) in hparams.items():
        full = f"{arch}.{key}"
        if full not in drop_keys:
            getattr(writer, f"add_{kind}")(full, value)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if mask_token_id is not None:
        writer.add_mask_token_id(mask_token_id)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _tiny_tensors(n_layer: int, n_embd: int, rng: Any, qk_norm: int = 0) -> dict[str, object]:
    """Blocks with llama-style names (shared by the llama and DFlash layouts) plus output_norm."""
    import numpy as np

    n_ff = 2 * n_embd

    def mat(rows: int, cols: int) -> Any:  # PyTorch shape [out, in]; ggml ne is the reverse
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)

    def ones(n: int) -> Any:
        return np.ones(n, dtype=np.float32)

    out: dict[str, object] = {"output_norm.weight": ones(n_embd)}
    for i in range(n_layer):
        out[f"blk.{i}.attn_norm.weight"] = ones(n_embd)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
            out[f"blk.{i}.{proj}.weight"] = mat(n_embd, n_embd)
        if qk_norm:
            out[f"blk.{i}.attn_q_norm.weight"] = ones(qk_norm)
            out[f"blk.{i}.attn_k_norm.weight"] = ones(qk_norm)
        out[f"blk.{i}.ffn_norm.weight"] = ones(n_embd)
        out[f"blk.{i}.ffn_gate.weight"] = mat(n_ff, n_embd)
        out[f"blk.{i}.ffn_up.weight"] = mat(n_ff, n_embd)
        out[f"blk.{i}.ffn_down.weight"] = mat(n_embd, n_ff)
    return out


def _tiny_hparams(n_layer: int, n_embd: int) -> dict[str, tuple[str, object]]:
    return {
        "context_length": ("uint32", 256),
        "embedding_length": ("uint32", n_embd),
        "block_count": ("uint32", n_layer),
        "feed_forward_length": ("uint32", 2 * n_embd),
        "attention.head_count": ("uint32", TINY_HEADS),
        "attention.head_count_kv": ("uint32", TINY_HEADS),
        "attention.layer_norm_rms_epsilon": ("float32", 1e-5),
        "rope.freq_base": ("float32", 10000.0),
    }


def write_tiny_llama_gguf(
    path: str | os.PathLike[str],
    *,
    arch: str = "llama",
    n_layer: int = 2,
    n_embd: int = 64,
    drop_tensors: Sequence[str] = (),
    extra_tensors: Sequence[str] = (),
    drop_keys: Sequence[str] = (),
    seed: int = 0,
) -> Path:
    """A random-weight llama model (~5 MB, b11434's 32k SPM test vocab): a loadable, servable target.

    The knobs make broken variants whose llama.cpp errors tests assert on; keys are written under
    `arch`, so e.g. arch="dflash" reaches the DFlash hparam loader. Needs numpy and gguf.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    n_vocab = len(_tiny_vocab()[0])
    tensors = {
        "token_embd.weight": (rng.standard_normal((n_vocab, n_embd)) * 0.02).astype(np.float16),
        **_tiny_tensors(n_layer, n_embd, rng),
    }
    hparams = _tiny_hparams(n_layer, n_embd)
    return _write_tiny(
        path,
        arch,
        hparams,
        tensors,
        drop_tensors=drop_tensors,
        extra_tensors=extra_tensors,
        drop_keys=drop_keys,
    )


def write_tiny_dflash_gguf(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 1,
    n_embd: int = 64,
    target_layers: Sequence[int] = (1,),
    block_size: int = 16,
    mask_token_id: int | None = 0,
    drop_tensors: Sequence[str] = (),
    extra_tensors: Sequence[str] = (),
    drop_keys: Sequence[str] = (),
    seed: int = 1,
) -> Path:
    """A random-weight DFlash drafter in b11434's layout (11·L + 3 tensors) for the tiny llama target.

    `target_layers` are GGUF values (HF id + 1) and must stay below the target's n_layer. Written from
    the format reference, not by our converter: it proves the harness, not the converter.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    k = len(target_layers)
    tensors = {
        "fc.weight": (rng.standard_normal((n_embd, k * n_embd)) * 0.02).astype(np.float16),
        "enc.output_norm.weight": np.ones(n_embd, dtype=np.float32),
        **_tiny_tensors(n_layer, n_embd, rng, qk_norm=n_embd // TINY_HEADS),
    }
    hparams = _tiny_hparams(n_layer, n_embd)
    hparams["block_size"] = ("uint32", block_size)
    hparams["target_layers"] = ("array", [int(t) for t in target_layers])
    return _write_tiny(
        path,
        "dflash",
        hparams,
        tensors,
        drop_tensors=drop_tensors,
        extra_tensors=extra_tensors,
        drop_keys=drop_keys,
        mask_token_id=mask_token_id,
    )
