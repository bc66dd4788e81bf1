"""The target converted while its shards download (``dflash-convert`` from repo ids against a loopback Hub that serves
at a fixed rate): the same files as downloading first, the disk bounded with --no-keep-source, a run killed mid-stream
rerun to the same files, the plan naming what is still to fetch; and the shard stream's own order, window and
errors with a fetch that writes files. Structure, files and disk, never time."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import fixtures as mf
import hub_server
import pytest
from hub_server import FakeRepo

from dflash_gguf.arrivals import Reading, ShardStream, StreamShard, streaming
from dflash_gguf.errors import DownloadError

BIN = Path(sys.executable).parent
TARGET_REPO, DRAFTER_REPO = "google/gemma-4-12B-it", "z-lab/gemma4-12B-it-DFlash"
N_SHARDS = 8
RATE = 400_000  # bytes per second, every file together: the fixture's ~0.7 MB take about two seconds


# ---------------------------------------------------------------------------------------------- the stream


def _shards(tmp_path: Path, n: int) -> list[StreamShard]:
    return [StreamShard(f"s{i}", tmp_path / f"s{i}", tmp_path / f"s{i}", {}, 8, 100) for i in range(n)]


def _writing_fetch(log: list[str], on_disk: list[int], lock: threading.Lock,
                   fail: str | None = None) -> Callable[[StreamShard, Callable[[int], None]], None]:
    def fetch(shard: StreamShard, on_bytes: Callable[[int], None]) -> None:
        time.sleep(0.01)
        if shard.name == fail:
            raise DownloadError("the link dropped", repo="acme/x", revision="main")
        shard.path.write_bytes(b"\0" * shard.size)
        on_bytes(shard.size)
        with lock:
            log.append(shard.name)
            on_disk.append(sum(1 for p in shard.path.parent.iterdir()))

    return fetch


def test_the_stream_fetches_in_the_readers_order_within_its_window(tmp_path: Path) -> None:
    shards = _shards(tmp_path, 8)
    log: list[str] = []
    on_disk: list[int] = []
    stream = ShardStream(shards, _writing_fetch(log, on_disk, threading.Lock()), workers=2, window=3,
                         remove_consumed=True, eager=False)
    # the writer reads s7 first, then the others in order, two tensors from each
    order = [shards[7].path] + [s.path for s in shards[:7]]
    reads = [(p,) for p in order for _ in range(2)]
    with streaming(stream):
        assert not log  # not eager: nothing before the first need
        reading = Reading(reads)
        for i in range(len(reads)):
            reading.wait(i)
            assert reads[i][0].is_file()
            removed = reading.done(i)
            assert removed == ([reads[i][0]] if i % 2 else [])  # gone after its last tensor
    assert "s7" in log[:2] and sorted(log) == sorted(s.name for s in shards)  # two fetch at once: s7 among the first
    assert max(on_disk) <= 3  # never more than the window on disk
    assert not list(tmp_path.iterdir())
    assert stream.downloaded_bytes == 800


def test_a_failed_shard_is_the_readers_error(tmp_path: Path) -> None:
    shards = _shards(tmp_path, 3)
    stream = ShardStream(shards, _writing_fetch([], [], threading.Lock(), fail="s1"), workers=1)
    with streaming(stream), pytest.raises(DownloadError, match="the link dropped"):
        Reading([(s.path,) for s in shards]).wait(1)


def test_a_shard_read_again_after_it_was_removed_is_refused(tmp_path: Path) -> None:
    shards = _shards(tmp_path, 2)
    stream = ShardStream(shards, _writing_fetch([], [], threading.Lock()), remove_consumed=True)
    with streaming(stream):
        first = Reading([(shards[0].path,)])
        first.wait(0)
        assert first.done(0) == [shards[0].path]
        with pytest.raises(Exception, match="read again after it was consumed"):
            Reading([(shards[0].path,)]).wait(0)


# ---------------------------------------------------------------------------------------------- the pipeline


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _outputs(outdir: Path) -> dict[str, str]:
    return {p.name: _sha(p) for p in sorted(outdir.glob("*.gguf"))}


def _du(folder: Path) -> int:
    total = 0
    for base, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass  # removed while we walked
    return total


def _streaming_in(folder: Path, shards: set[str]) -> int:
    """Shards on disk under ``folder``: complete ones, and downloads in flight (the Hub client's ``.incomplete``)."""
    return sum(1 for _, _, files in os.walk(folder) for name in files
               if name in shards or name.endswith(".incomplete"))


def _repos(root: Path, towers: str | None = None) -> dict[str, FakeRepo]:
    target = mf.make_sharded(mf.make_gemma4_target(root / "t", **({"towers": towers} if towers else {})), N_SHARDS)
    drafter = mf.make_drafter(root / "d", target="gemma4")
    return {TARGET_REPO: FakeRepo({p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}),
            DRAFTER_REPO: FakeRepo({p.name: p.read_bytes() for p in drafter.iterdir() if p.is_file()})}


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FakeRepo]:
    return _repos(tmp_path_factory.mktemp("stream-fx"))


@pytest.fixture(scope="module")
def vision_repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FakeRepo]:
    """A Gemma-4 image-text target: its projector's conversion reads the towers' shards after the target's."""
    return _repos(tmp_path_factory.mktemp("stream-vision-fx"), "vision")


def _shard_names(repos: dict[str, FakeRepo]) -> list[str]:
    return sorted(n for n in repos[TARGET_REPO].files if n.endswith(".safetensors"))


def _env(url: str, home: Path) -> dict[str, str]:
    return hub_server.client_env(url, home) | {"HF_HUB_DISABLE_TELEMETRY": "1"}


def _args(outdir: Path, *extra: str) -> list[str]:
    return [str(BIN / "dflash-convert"), "--target", TARGET_REPO, "--drafter", DRAFTER_REPO, "--quant", "q4_k_m",
            "--outdir", str(outdir), "--json", *extra]


def _convert(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def _download_first(repos: dict[str, FakeRepo], work: Path) -> dict[str, str]:
    """The files of a run that finds the checkpoint downloaded already (snapshot_download first, as users did), made
    offline."""
    with hub_server.serve(repos) as hub:
        env = _env(hub.url, work / "hf")
        subprocess.run([sys.executable, "-c", "from huggingface_hub import snapshot_download as s; "
                        f"s({TARGET_REPO!r}); s({DRAFTER_REPO!r})"], env=env, check=True, capture_output=True)
        before = len(hub.requests)
        run = _convert(_args(work / "pair"), env | {"HF_HUB_OFFLINE": "1"})  # the stream finds every shard here
        assert run.returncode == 0, run.stderr
        assert hub.requests[before:] == []
    return _outputs(work / "pair")


@pytest.fixture(scope="module")
def downloaded_first(repos: dict[str, FakeRepo], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _download_first(repos, tmp_path_factory.mktemp("downloaded-first"))


def test_a_streamed_run_makes_the_files_of_a_download_then_convert_run(repos: dict[str, FakeRepo],
                                                                      downloaded_first: dict[str, str],
                                                                      tmp_path: Path) -> None:
    with hub_server.serve(repos, rate=RATE) as hub:
        run = _convert(_args(tmp_path / "pair"), _env(hub.url, tmp_path / "hf"))
    assert run.returncode == 0, run.stderr
    assert _outputs(tmp_path / "pair") == downloaded_first
    doc = json.loads(run.stdout)
    streamed = doc["streamed"]
    sizes = {n: len(repos[TARGET_REPO].files[n]) for n in _shard_names(repos)}
    assert streamed["shards"] == N_SHARDS and streamed["downloaded_bytes"] == sum(sizes.values())
    assert streamed["kept"] is True
    assert streamed["waiting_on_network_seconds"] + streamed["converting_seconds"] == pytest.approx(
        streamed["seconds"], abs=0.002)
    snapshot = next((tmp_path / "hf" / "hub" / "models--google--gemma-4-12B-it" / "snapshots").iterdir())
    assert {n: (snapshot / n).stat().st_size for n in sizes} == sizes  # kept in the Hub cache, whole
    # each shard's header by range requests before its bytes, each shard's bytes once
    shard_gets = [r for r in hub.requests if r.method == "GET" and r.path.endswith(".safetensors")]
    assert {r.path.rsplit("/", 1)[-1] for r in shard_gets if r.range} >= set(sizes)
    whole = [r.path.rsplit("/", 1)[-1] for r in shard_gets if r.range is None and "DFlash" not in r.path]
    assert sorted(whole) == sorted(sizes)


def _assert_bounded(repos: dict[str, FakeRepo], made: dict[str, str], tmp_path: Path, held: int = 0) -> None:
    """A --no-keep-source run: ``made``'s files, no shard left anywhere, the sampled peak of (Hub cache + output
    folder) within the end state plus three of the largest shards (and ``held`` more: shards kept for a later pass),
    and between one and three shards (plus ``held``) seen at once."""
    home, outdir = tmp_path / "hf", tmp_path / "pair"
    shards = set(_shard_names(repos))
    peak, most = 0, 0  # bytes of the Hub cache and the output folder; shards on disk at once
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak, most
        while not stop.is_set():
            peak = max(peak, _du(home) + _du(outdir))
            most = max(most, _streaming_in(outdir, shards))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    with hub_server.serve(repos, rate=RATE) as hub:
        sampler.start()
        try:
            run = _convert(_args(outdir, "--no-keep-source"), _env(hub.url, home))
        finally:
            stop.set()
            sampler.join()
    assert run.returncode == 0, run.stderr
    assert _outputs(outdir) == made
    assert json.loads(run.stdout)["streamed"]["kept"] is False
    left = [p for p in [*home.rglob("*"), *outdir.rglob("*")] if p.name in shards or p.name.endswith(".incomplete")]
    assert not left, left  # no source shard anywhere, in the Hub cache or the work folder
    largest = max(len(repos[TARGET_REPO].files[n]) for n in shards)
    end = _du(home) + _du(outdir)  # the outputs and what the Hub cache keeps (the drafter, configs, tokenizer)
    assert peak <= end + (3 + held) * largest, (peak, end, largest)
    assert 1 <= most <= 3 + held, most  # seen streaming in, never more than three at once (and those held)


def test_no_keep_source_holds_a_few_shards_and_leaves_none(repos: dict[str, FakeRepo],
                                                          downloaded_first: dict[str, str], tmp_path: Path) -> None:
    _assert_bounded(repos, downloaded_first, tmp_path)


def test_no_keep_source_holds_the_towers_shards_for_the_projector(vision_repos: dict[str, FakeRepo],
                                                                   tmp_path: Path) -> None:
    """An image-text target: the projector reads its towers' shards after the target's pass, which holds the ones
    it reads too for it (the towers' own are fetched when the projector asks); the files are a download-then-convert
    run's, the projector among them."""
    made = _download_first(vision_repos, tmp_path / "first")
    assert any(name.startswith("mmproj-") for name in made)
    weight_map = json.loads(vision_repos[TARGET_REPO].files["model.safetensors.index.json"])["weight_map"]
    text = {shard for name, shard in weight_map.items() if name.startswith("model.language_model.")}
    shared = {shard for name, shard in weight_map.items() if not name.startswith("model.language_model.")} & text
    assert shared  # the fixture's towers share shards with the text (the embedding's, the one cut mid-tower)
    _assert_bounded(vision_repos, made, tmp_path / "bounded", held=len(shared))


def test_the_plan_streams_into_the_work_folder_with_no_keep_source(repos: dict[str, FakeRepo],
                                                                   tmp_path: Path) -> None:
    with hub_server.serve(repos) as hub:
        env = _env(hub.url, tmp_path / "hf")
        kept = _convert(_args(tmp_path / "pair", "--dry-run"), env)
        streamed = _convert(_args(tmp_path / "pair", "--dry-run", "--no-keep-source"), env)
    assert kept.returncode == streamed.returncode == 0, kept.stderr + streamed.stderr
    shards = set(_shard_names(repos))
    for run, want_kept in ((kept, True), (streamed, False)):
        plan = json.loads(run.stdout)["plan"]
        for d in plan["downloads"]:
            assert d["kept"] is (want_kept or d["file"] not in shards or "DFlash" in d["source"]), d
    need = {json.loads(r.stdout)["plan"]["disk"][0]["needed"] for r in (kept, streamed)}
    assert len(need) == 2  # streamed shards count a few at a time, not all


@pytest.mark.parametrize("extra", [[], ["--no-keep-source"]], ids=["kept", "no-keep-source"])
def test_a_run_killed_mid_stream_reruns_to_the_same_files(extra: list[str], repos: dict[str, FakeRepo],
                                                         downloaded_first: dict[str, str], tmp_path: Path) -> None:
    home, outdir = tmp_path / "hf", tmp_path / "pair"
    shards = _shard_names(repos)
    with hub_server.serve(repos, rate=RATE / 4) as hub:
        env = _env(hub.url, home)
        proc = subprocess.Popen(_args(outdir, *extra), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # two shards' bytes asked for: mid-stream
                if sum(1 for r in list(hub.requests) if r.method == "GET" and r.range is None
                       and r.path.rsplit("/", 1)[-1] in shards) >= 2:
                    break
                time.sleep(0.02)
            else:
                pytest.fail("the run never started streaming")
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 143, stdout + stderr
        assert not [p for p in outdir.rglob("*.partial")]
        # the plan names what the rerun must fetch: the shards not complete where the run keeps them
        dry = _convert(_args(outdir, "--dry-run", *extra), env)
        assert dry.returncode == 0, dry.stderr
        to_fetch = {d["file"] for d in json.loads(dry.stdout)["plan"]["downloads"]
                    if d["file"] in shards and d["cached"] < d["size"]}
        snapshot = home / "hub" / "models--google--gemma-4-12B-it" / "snapshots"
        here = {p.name for p in snapshot.rglob("*.safetensors") if p.exists()} if not extra else \
            {p.name for p in (outdir / ".dflash-work" / "source").rglob("*.safetensors")}
        assert to_fetch == set(shards) - here and to_fetch
    with hub_server.serve(repos) as hub:
        rerun = _convert(_args(outdir, *extra), _env(hub.url, home))
    assert rerun.returncode == 0, rerun.stderr
    assert _outputs(outdir) == downloaded_first


_SHORT_DISK = """
import collections, shutil, sys
from dflash_gguf.cli import convert_main as main
usage = collections.namedtuple("usage", "total used free")
shutil.disk_usage = lambda path: usage(10**12, 0, {free})  # a disk this small, wherever asked
sys.argv = ["dflash-convert", *{args!r}]
main()
"""


def test_a_disk_too_small_for_the_checkpoint_is_offered_no_keep_source(repos: dict[str, FakeRepo],
                                                                        tmp_path: Path) -> None:
    with hub_server.serve(repos) as hub:
        env = _env(hub.url, tmp_path / "hf")

        def needed(*extra: str) -> int:
            run = _convert(_args(tmp_path / "pair", "--dry-run", *extra), env)
            assert run.returncode == 0, run.stderr
            return sum(d["needed"] for d in json.loads(run.stdout)["plan"]["disk"])

        kept, streamed = needed(), needed("--no-keep-source")
        assert streamed < kept
        free = (kept + streamed) // 2  # holds the outputs and a few shards, not the whole checkpoint

        def short(*extra: str) -> subprocess.CompletedProcess[str]:
            code = _SHORT_DISK.format(free=free, args=_args(tmp_path / "pair", *extra)[1:])
            return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                                  stdin=subprocess.DEVNULL)

        refused = short()
        assert refused.returncode == 10, refused.stdout + refused.stderr
        message = json.loads(refused.stdout)["error"]["message"] if refused.stdout.startswith("{") else refused.stderr
        assert "With --no-keep-source" in message and "which fits" in message, message
        assert not (tmp_path / "pair").exists()  # nothing written
        fits = short("--no-keep-source")
        assert fits.returncode == 0, fits.stdout + fits.stderr
