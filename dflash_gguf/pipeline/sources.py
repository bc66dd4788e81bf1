"""The two sources of a run: a Hub repo pinned to a commit, or a local folder, through ``dflash_gguf.hub``.

Why a layer here: the pipeline needs a stable identity for each source (what a later run compares to
decide whether a stage must run again) and the list of files a fetch would download (for the plan).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from .. import hub
from ..hub import CARD_AND_CONFIG, RepoFile, Resolved
from ..model_card import front_matter, read_card, str_list
from ..provenance import folder_label
from .manifest import SourceRecord


@dataclass(frozen=True)
class Source:
    """One side of the pair: what the user typed, where its files are, and where they came from."""

    spec: str
    resolved: Resolved

    @property
    def path(self) -> Path:
        return self.resolved.path

    @property
    def repo(self) -> str | None:
        return self.resolved.repo

    @property
    def commit(self) -> str | None:
        return self.resolved.commit

    @property
    def label(self) -> str:
        """``org/name@commit`` for a repo, the folder path for a local folder."""
        return self.resolved.label

    @property
    def public(self) -> str:
        """``org/name@commit`` for a repo, the folder's name for a local folder: how files that may be published
        name it."""
        return self.label if self.repo else folder_label(self.path.resolve())

    @property
    def repo_spec(self) -> str | None:
        """``org/name@commit`` for provenance, None for a local folder."""
        return f"{self.repo}@{self.commit}" if self.repo else None

    def identity(self) -> str:
        """What decides whether outputs made from this source are still current: the pinned commit of a
        repo, or a folder's name plus a hash of the names, sizes and mtimes of its files (never the path to it:
        pair.json may be published)."""
        if self.repo:
            return f"{self.repo}@{self.commit}"
        h = hashlib.sha256()
        for p in sorted(self.path.iterdir()):
            if p.is_file() and not p.name.startswith("."):
                st = p.stat()
                h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return f"{folder_label(self.path.resolve())}#{h.hexdigest()[:16]}"

    def record(self) -> SourceRecord:
        """How pair.json records it: a repo at its commit, a local folder by its name only; with the license its
        card states (what publish puts on its own card)."""
        return SourceRecord(self.spec if self.repo else self.public, self.repo, self.commit,
                            None if self.repo else self.public,
                            tuple(str_list(front_matter(read_card(self.path)).get("license"))))


def public_spec(spec: str | None) -> str | None:
    """A file or Hub spec as a record that may be published names it: a local path by its name only."""
    if spec is None or not Path(spec).expanduser().exists():
        return spec
    return folder_label(Path(spec).expanduser().resolve())


def resolve_source(spec: str) -> Source:
    """Config and model card only (a repo is pinned to its commit here, and that commit is used for every
    later file).

    Raises:
        InputError, ResolveError: see :func:`dflash_gguf.hub.resolve`.
    """
    return Source(spec, hub.resolve(spec, CARD_AND_CONFIG))


def fetch_source(source: Source, patterns: tuple[str, ...], *, progress: bool = True) -> Source:
    """The files matching ``patterns`` at the pinned commit (a local folder is returned unchanged).

    Raises:
        ResolveError: the download failed (partial downloads resume on the next run).
    """
    if source.repo is None:
        return source
    patterns = tuple(dict.fromkeys((*CARD_AND_CONFIG, *patterns)))
    return Source(source.spec, hub.fetch(source.resolved, patterns, progress=progress))


def list_source_files(source: Source, patterns: tuple[str, ...]) -> list[RepoFile]:
    """What :func:`fetch_source` would bring, with sizes (None when the Hub does not say)."""
    return hub.list_files(source.resolved, patterns)


def cached_size(source: Source, name: str) -> int:
    """Bytes of ``name`` already in the local Hugging Face cache at the pinned commit (0 when absent)."""
    if source.repo is None:
        return 0

    hit = try_to_load_from_cache(source.repo, name, revision=source.commit)
    return os.path.getsize(hit) if isinstance(hit, str) and os.path.isfile(hit) else 0
