"""The target's shards converted as they arrive: which runs stream, where the shards go, and what the run reports.

A run from a Hub repo whose target the built-in converter makes from several shards does not download the
checkpoint first: the shards' headers are read by range requests, the conversion is planned from them, and its
writer waits for each shard as it needs it while the next ones download (``arrivals``). The Hub cache keeps the
shards as a plain download would (a second run reads them from disk); with ``--no-keep-source`` they go to the run's
work folder instead, never the user's Hub cache, and each is removed once its last tensor is written.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import hub
from ..arrivals import ShardStream, streaming
from ..hub import INDEX
from .naming import model_name
from .options import PipelineOptions, makes_in_one_pass
from .sources import Source, list_source_files

SOURCE_DIR = "source"  # in the run's work folder: --no-keep-source's shards, each removed once consumed
WORKERS = 2  # shards downloading at once
WINDOW = 3  # --no-keep-source: shards on disk at once (arrived or downloading), the one being read among them


@dataclass(frozen=True)
class StreamSummary:
    """What a streamed target cost: bytes fetched, the run's time from the first request to the last shard's
    consumer, and the part of it the converter waited on the network (the rest it converted)."""

    shards: int
    downloaded_bytes: int
    seconds: float
    waited_seconds: float
    kept: bool  # the shards stay in the Hub cache (False: --no-keep-source, none left)

    @property
    def converting_seconds(self) -> float:
        return max(self.seconds - self.waited_seconds, 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"shards": self.shards, "downloaded_bytes": self.downloaded_bytes, "seconds": round(self.seconds, 3),
                "waiting_on_network_seconds": round(self.waited_seconds, 3),
                "converting_seconds": round(self.converting_seconds, 3), "kept": self.kept}

    def line(self) -> str:
        where = "kept in the Hub cache" if self.kept else "removed once consumed (--no-keep-source)"
        return (f"streamed {self.shards} shards ({self.downloaded_bytes / 1e6:.1f} MB fetched) in "
                f"{self.seconds:.1f} s: {self.waited_seconds:.1f} s waiting on the network, "
                f"{self.converting_seconds:.1f} s converting; shards {where}")


def shard_names(target: Source) -> list[str]:
    """The target's weight shards, when it streams: a Hub repo with a shard index (several files, listed by it)."""
    if target.repo is None:
        return []
    files = [f.path for f in list_source_files(target, ("*.safetensors", INDEX))]
    if INDEX not in files:
        return []
    return sorted(f for f in files if f.endswith(".safetensors"))


def reads_once(opts: PipelineOptions) -> bool:
    """Whether the run's tags read the target's checkpoint once, so a streamed shard can go as soon as it is consumed:
    one pass or one 16-bit conversion makes every tag (a projector's towers are held for it: ``ShardStream.hold``)."""
    return not opts.several_tags or all(makes_in_one_pass(opts, tag, target=True) for tag in opts.tags)


def complete_bytes(path: Path, size: int | None) -> int:
    """Bytes of a streamed shard already complete in the run's work folder (a run stopped before it was consumed)."""
    return size if size and path.is_file() and path.stat().st_size == size else 0


def source_dir(work: Path, target: Source) -> Path:
    """Where ``--no-keep-source`` puts the target's shards: the run's own work folder."""
    return work / SOURCE_DIR / model_name(target.repo, target.path)


@contextlib.contextmanager
def streamed(target: Source, names: list[str], into: Path | None, *, remove_consumed: bool, eager: bool,
             progress: Callable[[int, int], None]) -> Iterator[tuple[ShardStream, Callable[[], StreamSummary]]]:
    """The shards ``names`` streaming in while the block runs (into the Hub cache, or ``into``); yields the stream and
    a function giving the summary so far. ``remove_consumed``: each shard removed once its last tensor is written (the
    run reads the checkpoint once); every shard fetched ``into`` the work folder is removed at the end anyway.
    ``eager``: fetching starts now, else at the conversion's first need.

    Raises:
        ResolveError, InputError: a shard's header could not be read (from :func:`hub.stream_shards`).
    """
    if into is not None:
        into.mkdir(parents=True, exist_ok=True)
    shards, fetch, read_range = hub.stream_shards(target.resolved, names, into)
    total = sum(s.size for s in shards)
    lock = threading.Lock()
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            progress(done, total)

    stream = ShardStream(shards, fetch, workers=WORKERS, window=WINDOW,
                         remove_consumed=remove_consumed and into is not None, eager=eager, on_bytes=on_bytes,
                         read_range=read_range)
    start = time.monotonic()

    def summary() -> StreamSummary:
        return StreamSummary(len(shards), stream.downloaded_bytes, time.monotonic() - start, stream.waited_seconds,
                             into is None)

    with streaming(stream):
        yield stream, summary
    if into is not None:  # the client's download records beside the shards, then the folder
        shutil.rmtree(into, ignore_errors=True)
