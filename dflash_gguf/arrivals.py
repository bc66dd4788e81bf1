"""Checkpoint shards still arriving while the conversion runs: the one gate between a download and the readers.

Why a process-wide gate: the converters, the one-pass quantizer and the GGUF writer open a checkpoint tensor by its
path (``TensorRef.path``) deep inside their loops. While a stream is open (:func:`streaming`), a shard's header is
known before its bytes (a range read), so the conversion is planned at once; each writer loop then waits, tensor by
tensor, for the shards that tensor reads (:meth:`Reading.wait`) and reports it written (:meth:`Reading.done`), which
lets a stream that does not keep its source remove a shard as soon as its last tensor is out. With no stream open,
every call here is a no-op, and nothing about a conversion from a complete folder changes.

The stream downloads in the order the writers need the shards, a few at once; a stream that removes what was
consumed keeps at most ``window`` shards on disk (arrived, or in flight), never refusing the one a reader waits for.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import DflashGgufError


@dataclass(frozen=True)
class StreamShard:
    """One shard of a streamed checkpoint: where the checkpoint's folder names it (``expected``), where its bytes
    land (``path``: the same file, or one in the run's work folder), its safetensors header as a range read found it
    (``header``, ``data_start``) and its size."""

    name: str
    expected: Path
    path: Path
    header: dict[str, Any]
    data_start: int
    size: int


@dataclass
class _State:
    shard: StreamShard
    arrived: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    released: bool = False
    error: BaseException | None = None


# fetch(shard, on_bytes) downloads one shard to shard.path (complete when it returns)
Fetch = Callable[[StreamShard, Callable[[int], None]], None]
# read_range(shard, offset, n) -> n bytes of the shard from the network, while the shard is on its way
ReadRange = Callable[[StreamShard, int, int], bytes]


class StreamClosed(Exception):
    """Raised inside a download's byte count once the stream is closed: the download stops where it is (the Hub
    client keeps its partial file and resumes it next time)."""


class ShardStream:
    """Downloads ``shards`` with ``workers`` threads in the order the readers need them; see the module's docstring.

    ``remove_consumed``: a shard is deleted once every tensor of the pass that reads it is written (and any shard
    left at :meth:`close`); then at most ``window`` shards are kept or fetched at once. ``eager``: downloads begin
    when the stream opens; else when a reader first says what it needs (nothing is fetched for a run that reads
    nothing)."""

    def __init__(self, shards: Sequence[StreamShard], fetch: Fetch, *, workers: int = 2, window: int = 3,
                 remove_consumed: bool = False, eager: bool = True,
                 on_bytes: Callable[[int], None] | None = None, read_range: ReadRange | None = None) -> None:
        self._states = {s.path: _State(s) for s in shards}
        self._by_expected = {s.expected: s for s in shards}
        self._order = [s.path for s in shards]
        self._fetch, self._on_bytes, self._read_range = fetch, on_bytes, read_range
        self.remove_consumed, self.window = remove_consumed, max(1, window)
        self._cond = threading.Condition()
        self._wanted: set[Path] = set()  # shards a reader is blocked on
        self._held: set[Path] = set()  # shards a later pass reads: not removed when this one is done with them
        self._needed: set[Path] = set()  # the shards the pass now reading reads (need)
        self._closed = False
        self.eager = eager
        self._started = False
        self._ordered = False  # a reader said the order it needs the shards in (need)
        self.waited_seconds = 0.0  # readers' time blocked on the network
        self.downloaded_bytes = 0
        self._threads = [threading.Thread(target=self._work, name=f"shard-stream-{i}", daemon=True)
                         for i in range(max(1, workers))]

    # -- the downloading side
    def start(self) -> None:
        with self._cond:
            if self._started:
                return
            self._started = True
        for t in self._threads:
            t.start()

    def _on_disk(self) -> int:
        return sum(1 for s in self._states.values() if s.started and not s.released)

    def _next(self) -> _State | None:
        """The next shard to fetch, or None to stop; waits while the window is full."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                todo = [self._states[p] for p in self._order if not self._states[p].started]
                if not todo:
                    return None
                if self.remove_consumed and self._ordered:  # in bounded disk, only what the pass reading needs
                    todo = [t for t in todo if t.shard.path in self._needed or t.shard.path in self._wanted]
                wanted = [s for s in todo if s.shard.path in self._wanted]  # a reader is blocked on it
                # before the readers say their order, one shard in the checkpoint's order: a guess that fills the
                # window could hold shards the readers want last while the one they want first waits
                window = self.window if self._ordered else 1
                if todo and (wanted or not self.remove_consumed or self._on_disk() < window):
                    first = (wanted or todo)[0]
                    first.started = True
                    return first
                self._cond.wait()

    def _work(self) -> None:
        while (state := self._next()) is not None:
            try:
                self._fetch(state.shard, self._count)
            except BaseException as e:  # handed to the reader that waits for it
                state.error = e
            with self._cond:
                state.arrived.set()
                self._cond.notify_all()

    def _count(self, n: int) -> None:
        with self._cond:
            if self._closed:
                raise StreamClosed
            self.downloaded_bytes += n
        if self._on_bytes is not None:
            self._on_bytes(n)

    # -- the reading side
    def header(self, expected: Path) -> StreamShard | None:
        return self._by_expected.get(expected)

    def pending(self, path: Path) -> bool:
        state = self._states.get(path)
        return state is not None and not state.arrived.is_set()

    def need(self, order: Sequence[Path]) -> None:
        """The readers' order of first use: fetch in it from now on."""
        known = [p for p in dict.fromkeys(order) if p in self._states]
        with self._cond:
            self._ordered = True
            self._needed = set(known)
            self._order = known + [p for p in self._order if p not in set(known)]
            self._cond.notify_all()
        if known:
            self.start()

    def wait(self, paths: Sequence[Path]) -> None:
        """Block until each of ``paths`` this stream fetches has arrived.

        Raises:
            DflashGgufError: its download failed (the hub's own error, one paragraph), or it was read again after
                the stream removed it.
        """
        for path in paths:
            state = self._states.get(path)
            if state is None:
                continue
            if state.released:
                raise DflashGgufError(f"Internal error: {state.shard.name} was read again after it was consumed and "
                                      "removed; re-run without --no-keep-source.")
            if not state.arrived.is_set():
                self.start()
                t0 = time.monotonic()
                with self._cond:
                    self._wanted.add(path)
                    self._cond.notify_all()
                state.arrived.wait()
                self.waited_seconds += time.monotonic() - t0
            if state.error is not None:
                raise state.error

    def read(self, path: Path, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """The bytes of a few small ``(offset, n)`` ranges of a shard still on its way, by range requests (None: read
        the file; it is here, or this stream cannot read ranges)."""
        state = self._states.get(path)
        if state is None or state.arrived.is_set() or self._read_range is None:
            return None
        return [self._read_range(state.shard, offset, n) for offset, n in ranges]

    def hold(self, paths: Iterable[Path]) -> None:
        """Keep ``paths`` when the pass now reading is done with them: a later pass reads them too."""
        with self._cond:
            self._held |= set(paths) & set(self._states)

    def unhold(self) -> None:
        """The later pass begins: its own last use of a held shard removes it (and :meth:`close` any left)."""
        with self._cond:
            self._held.clear()

    def release(self, path: Path) -> bool:
        """A reader is finished with ``path``; a stream that removes what it consumed deletes it (unless a later pass
        holds it). True: deleted."""
        state = self._states.get(path)
        if state is None or not self.remove_consumed or state.released or not state.arrived.is_set() \
                or path in self._held:
            return False
        state.shard.path.unlink(missing_ok=True)
        with self._cond:
            state.released = True
            self._wanted.discard(path)
            self._cond.notify_all()
        return True

    def close(self) -> None:
        """Stop fetching (a download in flight stops at its next chunk), and with ``remove_consumed`` remove every
        shard fetched."""
        with self._cond:
            self._closed = True
            self._held.clear()
            self._cond.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join()
        if self.remove_consumed:
            for path, state in self._states.items():
                if state.arrived.is_set():
                    self.release(path)


_active: ShardStream | None = None


@contextlib.contextmanager
def streaming(stream: ShardStream) -> Iterator[ShardStream]:
    """Make ``stream`` the one every reader in this process waits on, while the block runs."""
    global _active
    if _active is not None:
        raise AssertionError("one shard stream at a time")
    _active = stream
    if stream.eager:
        stream.start()
    try:
        yield stream
    finally:
        _active = None
        stream.close()


def arriving(expected: Path) -> StreamShard | None:
    """The streamed shard the checkpoint folder names ``expected`` (its header known, its bytes maybe not yet)."""
    return _active.header(expected) if _active is not None else None


def read_ranges(path: Path, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
    """A few small ranges of a streamed shard not here yet, from the network (None: read them from the file)."""
    return _active.read(path, ranges) if _active is not None else None


def pending(path: Path) -> bool:
    """Whether ``path`` is a streamed shard not complete yet (its bytes must not be read)."""
    return _active is not None and _active.pending(path)


class Reading:
    """One pass of a writer over its tensors (each reading the files ``reads[i]``), in order."""

    def __init__(self, reads: Sequence[tuple[Path, ...]]) -> None:
        self._stream = _active
        self._reads = reads
        self._last: dict[Path, int] = {}
        if self._stream is not None:
            for i, paths in enumerate(reads):
                for p in paths:
                    self._last[p] = i
            self._stream.need([p for paths in reads for p in paths])

    def pending(self, i: int) -> bool:
        """Whether tensor ``i`` reads a shard not here yet (a writer ahead of its output drains first, so the shards
        it is finished with go before it waits for the next)."""
        return self._stream is not None and any(map(self._stream.pending, self._reads[i]))

    def wait(self, i: int) -> None:
        if self._stream is not None:
            self._stream.wait(self._reads[i])

    def done(self, i: int) -> list[Path]:
        """Tensor ``i`` is written: the files no later tensor of the pass reads, removed if the stream removes."""
        if self._stream is None:
            return []
        return [p for p in self._reads[i] if self._last.get(p) == i and self._stream.release(p)]
