"""Shared fixtures (tiny HF repos generated offline per session) and the reference-comparison count.

The count: a test that compares our output with llama.cpp b11434 is marked ``@pytest.mark.reference``
and appends a label to ``REFERENCE_COMPARISONS`` once it has compared. The marks are the one place
where the expected comparisons are declared. At the end of the session every selected marked test
must have appended at least once:
- a marked test that passed without appending is a broken test, and fails the run everywhere;
- a marked test that was skipped (the reference is absent) fails the run on CI (``CI=true``) only,
  so local runs without the reference still pass.
Appends from tests without the mark are counted and listed in the summary; with
``UNMARKED_APPENDS_FAIL`` they fail the run too, so a mark cannot be dropped from a comparing test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import fixtures as mf
import in_process
import process_tally
import pytest
import ref_cache
import reference

from dflash_gguf.quantize import kernels

REFERENCE_COMPARISONS: list[str] = []
REFERENCE_MARK = "reference"
# Every comparing test is marked, so an append from an unmarked test is a dropped mark: fail the run.
UNMARKED_APPENDS_FAIL = True

# A run started in the background by a non-interactive shell (``cmd &``, nohup) inherits SIGINT ignored, and
# so would every child it starts, so the Ctrl-C tests could not interrupt their converters. A handler of ours
# is reset to the default in each child, where Python then turns SIGINT into KeyboardInterrupt as usual.
process_tally.install()  # the summary's per-kind table of child processes

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

_appended: dict[str, list[str]] = {}  # nodeid -> labels appended while that test ran
_outcome: dict[str, str] = {}  # nodeid -> "passed" | "failed" | "skipped"
_problems: list[str] = []  # filled by pytest_sessionfinish, printed by pytest_terminal_summary
_marked_ids: list[str] = []  # selected marked tests, in collection order
_before_key = pytest.StashKey[int]()  # len(REFERENCE_COMPARISONS) when the test started


# The kernel variants every kernel test runs on: the compiled kernels at the CPU's widest instruction set, the numpy
# fallback, and the compiled kernels capped at each narrower set this CPU has (on AVX-512: AVX2 and the portable
# code), so that every path is held to libggml here. Only levels the CPU has are generated, and none twice, so a
# variant never skips: on an AVX2-only CPU (or under DFLASH_GGUF_SIMD=avx2, which makes any CPU look like one) the
# plain 'compiled' variant is the AVX2 code and 'compiled-portable' the rest.
NARROWER_SIMD_VARIANTS = tuple(f"compiled-{level}" for level in kernels.simd_levels()[:-1])
KERNEL_VARIANTS = (*kernels.KERNEL_PATHS, *NARROWER_SIMD_VARIANTS)


def use_kernels(path: str) -> Iterator[str]:
    """Make ``path`` (one of KERNEL_VARIANTS) the active kernel path for one test, restoring the previous one
    afterwards; the compiled kernels skip, or fail on CI, when the extension was not built."""
    if path.startswith("compiled") and not kernels.compiled_available():
        reason = "the compiled kernels are not built: reinstall with a C compiler (pip install -e '.[test]')"
        if reference.on_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    base, _, level = path.partition("-")
    previous, previous_simd = kernels.kernel_path(), kernels.simd()
    kernels.set_kernel_path(base)
    if base == "compiled":
        kernels.set_simd(level or kernels.simd_levels()[-1])
    try:
        yield path
    finally:
        kernels.set_kernel_path(previous)
        if previous_simd is not None:
            kernels.set_simd(previous_simd)


@pytest.fixture(params=KERNEL_VARIANTS)
def kernel_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on the compiled kernels (at every instruction set this CPU has) and on the numpy fallback."""
    yield from use_kernels(request.param)


def llama_cpp_src() -> Path | None:
    """The b11434 source tree when it is set up, else None (the Qwen fixtures then need the guard)."""
    return None if reference.llama_cpp_src_available() else reference.env.llama_cpp_src()


# Environment names read when a module is imported (huggingface_hub's constants): a run that sets one needs its
# own process, since an in-process run would see the values of the test process's first import.
_IMPORT_TIME_ENV_PREFIXES = ("HF_", "HUGGINGFACE_")


def run_cli(exe: str, *args: str | Path, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One of our console scripts, offline (no Hub, no llama-quantize unless ``env`` names one), stdin closed.

    Runs in this process through Click's test runner, which is what the console script calls, with the module
    state a fresh process would have; ``run_cli_process`` starts the real console script where the process itself
    is the point, and so does this function when ``env`` sets a name read at import time."""
    if any(name.startswith(_IMPORT_TIME_ENV_PREFIXES) for name in env or {}):
        return run_cli_process(exe, *args, cwd=cwd, env=env)
    return in_process.run(exe, [str(a) for a in args], cwd=cwd, env={"LLAMA_QUANTIZE": "", **(env or {})},
                          offline=True)


def run_tune(*args: str | Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], dict]:
    """``dflash-gguf tune ARGS`` as a console script with b11434's llama-server (a process: tune starts servers
    and stops them by their process group), ``env`` added; returns the process and its ``--json`` document ({}
    without one)."""
    proc = subprocess.run([str(Path(sys.executable).parent / "dflash-gguf"), "tune", *map(str, args)],
                          capture_output=True, text=True, env=reference.llama_server_env() | (env or {}),
                          stdin=subprocess.DEVNULL, timeout=900)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        doc = {}
    return proc, doc


def run_cli_process(exe: str, *args: str | Path, cwd: Path | None = None,
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed console script in a child process, offline, stdin closed."""
    full_env = {**os.environ, "LLAMA_QUANTIZE": "", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([str(Path(sys.executable).parent / exe), *map(str, args)], capture_output=True, text=True,
                          env=full_env, cwd=cwd, stdin=subprocess.DEVNULL, timeout=600)


class Targets(dict):
    """Target fixture folders by family. A missing family goes through the guard, never a silent skip."""

    def __missing__(self, family: str) -> Path:
        if family == "qwen3":
            reference.require_or_skip(reference.llama_cpp_src_available())
        raise KeyError(family)


@pytest.fixture(autouse=True)
def own_made_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own $XDG_CACHE_HOME, so what one test made (an --imatrix auto matrix, a base's logits:
    dflash_gguf.made_cache) is never another's, and the user's cache is never written."""
    home = tmp_path_factory.mktemp("xdg-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The standard targets and drafters (Qwen ones only when the b11434 sdist is present)."""
    return mf.make_all(tmp_path_factory.mktemp("fx"), llama_cpp_src=llama_cpp_src())


@pytest.fixture(scope="session")
def demo_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline demo's output folder (the Gemma-4 fixture pair, built-in converters and quantizer)."""
    root = tmp_path_factory.mktemp("demo")
    target = mf.make_gemma4_target(root / "targets")
    drafter = mf.make_drafter(root / "drafters", target="gemma4")
    out = root / "pair"
    proc = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="session")
def targets(fixtures: dict[str, Path]) -> dict[str, Path]:
    """``targets["qwen3"]`` skips locally / fails on CI when the sdist is missing; ``"qwen3" in targets`` is safe."""
    out = Targets(gemma4=fixtures["gemma-4-tiny-it"])
    if "qwen3-tiny" in fixtures:
        out["qwen3"] = fixtures["qwen3-tiny"]
    return out


# ------------------------------------------------------------------------------ comparison count


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{REFERENCE_MARK}: compares with llama.cpp b11434 and must append to conftest.REFERENCE_COMPARISONS",
    )


_LABELS_PROPERTY = "reference_comparisons"  # how a test's appended labels travel in its reports (xdist workers)


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    item.stash[_before_key] = len(REFERENCE_COMPARISONS)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report = yield
    labels = REFERENCE_COMPARISONS[item.stash.get(_before_key, len(REFERENCE_COMPARISONS)):]
    if labels:
        report.user_properties.append((_LABELS_PROPERTY, list(labels)))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == _LABELS_PROPERTY:  # each phase carries every label so far: keep the latest
            _appended[report.nodeid] = list(value)
    if report.failed:
        _outcome[report.nodeid] = "failed"
    elif report.skipped and _outcome.get(report.nodeid) != "failed":
        _outcome[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed:
        _outcome.setdefault(report.nodeid, "passed")


def pytest_collection_finish(session: pytest.Session) -> None:
    _marked_ids[:] = [item.nodeid for item in session.items if item.get_closest_marker(REFERENCE_MARK) is not None]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist's controller: take a finished worker's marked tests, process tally and cache figures."""
    output = getattr(node, "workeroutput", {})
    _marked_ids.extend(nodeid for nodeid in output.get("marked_ids", []) if nodeid not in _marked_ids)
    process_tally.merge(output.get("tally", {}))
    ref_cache.merge(output.get("ref_cache", {}))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when a marked test did not compare (always if it passed, on CI if it skipped)."""
    if session.config.option.collectonly:
        return
    if _is_xdist_worker(session.config):  # the controller checks, with every worker's figures
        session.config.workeroutput.update(  # type: ignore[attr-defined]
            marked_ids=list(_marked_ids), tally=process_tally.export(), ref_cache=ref_cache.export())
        return
    for nodeid in _marked_ids:
        if _appended.get(nodeid):
            continue
        outcome = _outcome.get(nodeid)
        if outcome == "passed":
            _problems.append(f"{nodeid} passed without comparing (no REFERENCE_COMPARISONS.append)")
        elif outcome == "skipped" and reference.on_ci():
            _problems.append(f"{nodeid} was skipped on CI")
        elif outcome is None and exitstatus == pytest.ExitCode.OK:
            _problems.append(f"{nodeid} did not run")
    if UNMARKED_APPENDS_FAIL:
        _problems.extend(f"{nodeid} compared without @pytest.mark.{REFERENCE_MARK}"
                         for nodeid in sorted(set(_appended) - set(_marked_ids)))
    if _problems and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _is_xdist_worker(terminalreporter.config):
        return
    compared = [nodeid for nodeid in _marked_ids if _appended.get(nodeid)]
    labels = [label for nodeid in _appended for label in _appended[nodeid]]
    write = terminalreporter.write_line
    write("child processes by kind (count, wall seconds):")
    for line in process_tally.summary_lines():
        write(line)
    write("reference results reused from the cache / run afresh:")
    for line in ref_cache.summary_lines():
        write(line)
    write(f"reference comparisons against llama.cpp b11434: {len(labels)} ran, "
          f"from {len(compared)} of {len(_marked_ids)} selected tests marked @pytest.mark.{REFERENCE_MARK}"
          + (f" ({', '.join(labels)})" if labels else ""))
    unmarked = sorted(set(_appended) - set(_marked_ids))
    if unmarked:
        write(f"reference comparisons from tests without @pytest.mark.{REFERENCE_MARK} (mark them): "
              + ", ".join(unmarked), yellow=True)
    for problem in _problems:
        write(f"REFERENCE COUNT FAILURE: {problem}", red=True, bold=True)
