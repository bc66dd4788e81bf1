"""Hugging Face Hub access: a local folder or ``org/name[@revision]`` -> a local folder, pinned.

Only the files asked for are fetched (``allow_patterns``), into the user's Hugging Face cache through
the official client, which honours HF_HOME, HF_TOKEN, HF_HUB_OFFLINE and HF_ENDPOINT. Nothing here
ever writes into a snapshot, and no code from a repo is run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError, ResolveError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
CARD_AND_CONFIG = ("config.json", "README.md")


def is_repo_id(spec: str) -> bool:
    """``org/name[@revision]`` and not a path (``./x/y``, ``/x/y``, ``~/x``)."""
    return bool(REPO_ID.match(spec)) and not spec.startswith((".", "/", "~"))


@dataclass(frozen=True)
class Resolved:
    """A folder to read, and where it came from (repo and commit are None for a local folder)."""

    path: Path
    repo: str | None = None
    commit: str | None = None

    @property
    def label(self) -> str:
        return f"{self.repo}@{self.commit}" if self.repo else str(self.path)


def resolve(spec: str, patterns: tuple[str, ...] = CARD_AND_CONFIG) -> Resolved:
    """A local folder as is; a repo id fetched (only ``patterns``) and pinned to its commit.

    Raises:
        InputError: neither an existing folder nor a repo id.
        ResolveError: the repo, revision or files cannot be fetched (message says why and what to do).
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        return Resolved(path)
    if not is_repo_id(spec):
        raise InputError(f"{spec!r} is neither an existing folder nor a Hub repo id (org/name[@revision]).")
    repo, _, revision = spec.partition("@")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        local = Path(snapshot_download(repo, revision=revision or None, allow_patterns=list(patterns)))
    except GatedRepoError:
        raise ResolveError(f"{repo} is gated: accept its license on the Hub and set HF_TOKEN.") from None
    except RepositoryNotFoundError:
        raise ResolveError(f"Repository {repo} was not found on the Hub (or is private: set HF_TOKEN). "
                           "Check the repo id.") from None
    except RevisionNotFoundError:
        raise ResolveError(f"Revision {revision!r} of {repo} does not exist. Check the branch, tag or commit.") \
            from None
    except LocalEntryNotFoundError as e:
        raise ResolveError(f"Cannot reach the Hub for {repo} and it is not in the local cache ({e}). Check your "
                           "network, or unset HF_HUB_OFFLINE.") from None
    except OSError as e:
        raise ResolveError(f"Fetching {repo} failed: {e}. Retry; partial downloads resume.") from None
    return Resolved(local, repo, local.name)
