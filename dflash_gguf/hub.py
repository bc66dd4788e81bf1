"""Hugging Face Hub access: a local folder or ``org/name[@revision]`` -> a local folder, pinned to one commit.

Everything goes through the official ``huggingface_hub`` client, so HF_HOME, HF_TOKEN, HF_HUB_OFFLINE and
HF_ENDPOINT work as users expect, files land in the shared Hub cache, and its progress bars (stderr) show.
A repo is resolved to a commit once; every later file is fetched at that commit, so a branch that moves
mid-run cannot mix two versions. Only the files asked for are fetched, never pickles or other formats.
Nothing here writes into a snapshot, and no code from a repo is run.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import unquote

import httpx2
from huggingface_hub import (
    CommitOperationAdd,
    HfApi,
    constants,
    get_cached_repo_tree,
    get_token,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub import errors as hf
from huggingface_hub.hf_api import RepoFile as HfRepoFile
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
from huggingface_hub.utils import tqdm as hf_tqdm

from .arrivals import Fetch, ReadRange, StreamShard
from .convert.safetensors import MAX_HEADER, read_raw_header
from .convert.targets.projector import PREPROCESSOR_FILES
from .drafters import FAMILIES
from .errors import (
    ConfigError,
    DownloadError,
    HubOfflineError,
    InputError,
    RepoAccessError,
    RepoNotFoundError,
    ResolveError,
    RevisionNotFoundError,
    UnsupportedModelError,
    UploadError,
)
from .ggufio.reader import split_siblings
from .jsonfile import load_json, parse_bounded
from .relpath import name_problem

log = logging.getLogger(__name__)

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
FILE_SPEC = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?:(?P<file>[^:]+)$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")

CARD_AND_CONFIG = ("config.json", "README.md")
TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                      "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
                      "vocab.json", "merges.txt")
# A target's image/audio processor settings, which its projector (mmproj) conversion reads.
PROCESSOR_PATTERNS = tuple(name for name, _ in PREPROCESSOR_FILES)
# A target's files beside its weights: its tokenizer and its image/audio processor settings.
TARGET_PATTERNS = TOKENIZER_PATTERNS + PROCESSOR_PATTERNS
INDEX = "model.safetensors.index.json"
WEIGHT_PATTERNS = ("*.safetensors", INDEX)
# A drafter's files beyond its weights: its tokenizer (an MTP assistant converts with its own), and the files its
# family names (a DFlash drafter's mask_embedding.pt: read by a restricted unpickler, never by pickle.load).
DRAFTER_PATTERNS = (*WEIGHT_PATTERNS, *TOKENIZER_PATTERNS,
                    *dict.fromkeys(name for family in FAMILIES for name in family.fetch_files))
# Other serialisations of the same weights: never fetched through a wildcard (an exact name still is).
OTHER_FORMATS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle", "*.onnx", "*.onnx_data", "*.gguf",
                 "*.h5", "*.msgpack", "*.ot", "*.tflite", "*.npz", "*.mlmodel", "*.nemo")
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")
TRAINING_STATE = ("training_args", "optimizer", "scheduler", "rng_state", "trainer_state")  # pickles, not weights


def is_repo_id(spec: str) -> bool:
    """``org/name[@revision]`` and not a path (``./x/y``, ``/x/y``, ``~/x``)."""
    return bool(REPO_ID.match(spec)) and not spec.startswith((".", "/", "~"))


@dataclass(frozen=True)
class Resolved:
    """A folder to read, and where it came from (repo and commit are None for a local folder).

    ``revision`` is what the user asked for (``main`` when nothing was), kept for messages and records;
    ``commit`` is what every file is fetched at.
    """

    path: Path
    repo: str | None = None
    commit: str | None = None
    revision: str | None = None

    @property
    def label(self) -> str:
        return f"{self.repo}@{self.commit}" if self.repo else str(self.path)


@dataclass(frozen=True)
class FetchedFile:
    """One file to read (``--target-gguf``): where it is, and the repo and commit it came from (None: local)."""

    path: Path
    repo: str | None = None
    commit: str | None = None
    in_repo: str | None = None  # its path in the repo

    @property
    def name(self) -> str:
        """Its path in the repo, or a local file's name."""
        return self.in_repo or self.path.name

    @property
    def spec(self) -> str:
        """How a published record names it: ``org/name@commit:path/in/repo``, or a local file's name only."""
        return f"{self.repo}@{self.commit}:{self.name}" if self.repo else self.name


@dataclass(frozen=True)
class RepoFile:
    """One file ``fetch`` would download (path relative to the repo root) and its size in bytes."""

    path: str
    size: int | None  # None only when unknown
    local: bool = False  # already on this machine (a folder, or complete in the Hub cache): nothing to download

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "local": self.local}


# --- selection --------------------------------------------------------------------------------------------------

def _matches(path: str, pattern: str) -> bool:
    """fnmatch, except that a pattern without ``/`` matches top-level files only: ``*.safetensors`` must not
    pick up ``original/`` or ``onnx/`` copies of the weights."""
    return ("/" in pattern or "/" not in path) and fnmatchcase(path, pattern)


def _select(files: Iterable[str], patterns: tuple[str, ...]) -> list[str]:
    chosen = []
    for path in files:
        if path in patterns:
            chosen.append(path)
        elif any(_matches(path, p) for p in patterns) and not any(fnmatchcase(path.rsplit("/", 1)[-1], o)
                                                                   for o in OTHER_FORMATS):
            chosen.append(path)
    return sorted(chosen)


def _wants_weights(patterns: tuple[str, ...]) -> bool:
    return any(p.endswith(".safetensors") and any(c in p for c in "*?[") for p in patterns)


def _prune_to_index(chosen: list[str], read_index: Callable[[], Any], where: str) -> list[str]:
    """Keep only the shards the index names: some repos carry a second copy (``consolidated.safetensors``)."""
    if INDEX not in chosen or not any(p.endswith(".safetensors") for p in chosen):
        return chosen
    try:
        index = read_index()
    except (UnicodeDecodeError, ValueError) as e:
        raise UnsupportedModelError(f"{where}: {INDEX} is not readable JSON ({e}), so the safetensors shards that "
                                    "make up the model are unknown. Fix or remove the index file.") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UnsupportedModelError(f"{where}: {INDEX} has no 'weight_map', so the safetensors shards that make up "
                                    "the model are unknown. Fix or remove the index file.")
    if problems := sorted({p for v in weight_map.values() if (p := name_problem(v)) is not None}):
        raise UnsupportedModelError(f"{where}: {INDEX} names a shard that is not a file of the repo: {problems[0]}. "
                                    "Nothing outside the repo is read; fix or remove the index file.")
    shards = {str(v) for v in weight_map.values()}
    missing = sorted(shards - set(chosen))
    if missing:
        raise UnsupportedModelError(f"{where}: {INDEX} names shards that are not in the repo ({', '.join(missing)}). "
                                    "The upload is incomplete; pick another revision or tell the repo's authors.")
    return [p for p in chosen if not p.endswith(".safetensors") or p in shards]


def _check_weights(chosen: list[str], all_files: Iterable[str], patterns: tuple[str, ...], where: str) -> None:
    """Weights were asked for: refuse, before any download, a repo that has none in safetensors form."""
    if not _wants_weights(patterns) or any(p.endswith(".safetensors") for p in chosen):
        return
    top = [p for p in all_files if "/" not in p]
    pickles = [p for p in top if any(fnmatchcase(p, g) for g in PICKLES) and not p.startswith(TRAINING_STATE)]
    ggufs = [p for p in top if p.endswith(".gguf")]
    if pickles:
        raise UnsupportedModelError(
            f"{where} has only PyTorch pickle weights ({', '.join(sorted(pickles)[:4])}) and no *.safetensors. "
            "dflash-gguf reads safetensors only and never unpickles downloaded files. Use a revision or mirror with "
            "safetensors weights (the Hub often has a 'refs/pr/N' safetensors conversion: pass org/name@refs/pr/N), "
            "or convert the checkpoint to safetensors yourself.")
    extra = (f" It has GGUF files ({', '.join(sorted(ggufs)[:4])}): for a target, pass one with --target-gguf "
             "REPO:FILE." if ggufs else "")
    raise UnsupportedModelError(f"{where} has no *.safetensors weights at its top level.{extra} Check the repo id "
                                "and revision.")


def _literal(name: str) -> str:
    """An exact file name as an fnmatch pattern (for ``allow_patterns``)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


# --- errors ---------------------------------------------------------------------------------------------------

def _endpoint() -> str:
    return constants.ENDPOINT


def _cache_dir() -> str:
    return constants.HF_HUB_CACHE


def _offline() -> bool:
    return constants.is_offline_mode()


def _has_token() -> bool:
    return bool(get_token())


def _raise_translated(e: BaseException, repo: str, revision: str, file: str | None = None) -> NoReturn:
    """One paragraph per failure, naming the repo, the revision and what to do."""
    cause = e.__cause__
    if isinstance(e, hf.LocalEntryNotFoundError) and isinstance(cause, (hf.HfHubHTTPError, hf.FileMetadataError)):
        e = cause  # the client wraps an HTTP refusal it could not serve from the cache: report the refusal
    status = getattr(getattr(e, "response", None), "status_code", None)
    server = f": {getattr(e, 'server_message', None)}" if getattr(e, "server_message", None) else ""
    at = f"{repo} (revision {revision})"
    page = f"{_endpoint()}/{repo}"
    if isinstance(e, hf.GatedRepoError):
        if status == 403 or _has_token():
            raise RepoAccessError(
                f"{at} is a gated repo and the account of your token has not been granted access (HTTP {status}). "
                f"Open {page} while logged in with that account, accept the license (some repos also wait for the "
                "authors' approval), then re-run. HF_TOKEN must be a token of that same account.",
                repo=repo, revision=revision) from None
        raise RepoAccessError(
            f"{at} is a gated repo and the request carried no token (HTTP {status}). Accept its license at {page}, "
            "then set HF_TOKEN to a read token of that account (or run `hf auth login`), and re-run.",
            repo=repo, revision=revision) from None
    if isinstance(e, hf.RevisionNotFoundError):
        raise RevisionNotFoundError(
            f"Revision {revision!r} of {repo} does not exist on the Hub ({_endpoint()}). Check the branch, tag or "
            f"commit (the repo's 'Files and versions' page, {page}/tree/main, lists them), or drop '@{revision}' to "
            "use main.", repo=repo, revision=revision) from None
    if isinstance(e, hf.RemoteEntryNotFoundError):
        raise RepoNotFoundError(f"{file or 'A file'} is not in {repo} at revision {revision}. Check the file name "
                                f"against {page}/tree/{revision}.", repo=repo, revision=revision) from None
    if isinstance(e, hf.RepositoryNotFoundError):
        auth = ("A token was sent (HF_TOKEN or `hf auth login`): if the repo is private, its account cannot read it."
                if _has_token() else "If the repo is private, set HF_TOKEN to a token of an account that can read it.")
        raise RepoNotFoundError(f"Repository {repo} was not found on the Hub ({_endpoint()}, revision {revision}). "
                                f"Check the repo id for typos. {auth}", repo=repo, revision=revision) from None
    if isinstance(e, hf.HfHubHTTPError) and status in (401, 403):
        if status == 401:
            raise RepoAccessError(f"The Hub rejected the token sent for {at} as invalid (HTTP 401{server}). "
                                  "Set HF_TOKEN to a valid token (huggingface.co/settings/tokens), or unset it for "
                                  "public repos.", repo=repo, revision=revision) from None
        raise RepoAccessError(f"The Hub refused access to {at} (HTTP 403{server}). The token in "
                              "HF_TOKEN lacks read permission for this repo: use a token with read access (a "
                              "fine-grained token must list the repo).", repo=repo, revision=revision) from None
    if isinstance(e, (hf.OfflineModeIsEnabled, hf.RevisionResolutionError, hf.LocalEntryNotFoundError,
                      hf.CachedRepoTreeNotFoundError, httpx2.ConnectError, httpx2.ConnectTimeout)):
        _raise_offline(repo, revision, e, missing=[file] if file else ())
    if isinstance(e, OSError) and getattr(e, "errno", None) == 28:
        raise DownloadError(f"Disk full while downloading {at} into the Hugging Face cache ({_cache_dir()}): {e}. "
                            "Free space there, or point HF_HOME at a larger disk, and re-run.",
                            repo=repo, revision=revision) from None
    file = file or _url_file(e)
    what = f"{file} of {at}" if file else at
    raise DownloadError(
        f"Downloading {what} from {_endpoint()} failed: {type(e).__name__}: {_one_line(e)}. Re-run the same "
        "command: a connection cut mid-file is resumed with a Range request, and files already complete stay in "
        f"the Hugging Face cache ({_cache_dir()}) and are not downloaded again.",
        repo=repo, revision=revision) from None


def _raise_offline(repo: str, revision: str, e: BaseException | None = None, missing: Iterable[str] = ()) -> NoReturn:
    lacking = list(missing)
    what = (f"the cached copy lacks {', '.join(lacking[:4])}{' and more' if len(lacking) > 4 else ''}"
            if lacking else "it is not in the local Hugging Face cache")
    if _offline():
        raise HubOfflineError(
            f"HF_HUB_OFFLINE is set and {repo} (revision {revision}) cannot be served from the cache: {what} "
            f"({_cache_dir()}). Unset HF_HUB_OFFLINE (or set it to 0) so the files can be downloaded, or run once "
            "online with the same HF_HOME.", repo=repo, revision=revision) from None
    if e is not None and e.__cause__ is not None and type(e).__name__ == "RevisionResolutionError":
        e = e.__cause__  # the network error itself, not the client's summary of it
    reason = f" ({type(e).__name__}: {_one_line(e)})" if e is not None else ""
    raise HubOfflineError(
        f"Cannot reach the Hub at {_endpoint()} for {repo} (revision {revision}){reason}, and {what} "
        f"({_cache_dir()}). Check your network, proxy and HF_ENDPOINT, then retry.",
        repo=repo, revision=revision) from None


def _url_file(e: BaseException) -> str | None:
    """The file a failed request was for, from its URL (the client's download errors do not say)."""
    try:
        url = e.request.url  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None

    name = unquote(str(getattr(url, "path", "") or "")).rsplit("/", 1)[-1]
    return name or None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


@contextmanager
def _translated(repo: str, revision: str, file: str | None = None) -> Iterator[None]:
    try:
        yield
    except (ResolveError, UnsupportedModelError):
        raise
    except (hf.HfHubHTTPError, hf.OfflineModeIsEnabled, hf.RevisionResolutionError, hf.EntryNotFoundError,
            hf.CachedRepoTreeNotFoundError, OSError) as e:
        _raise_translated(e, repo, revision, file)
    except Exception as e:
        if isinstance(e, httpx2.HTTPError):
            _raise_translated(e, repo, revision, file)
        raise


# --- pinning and listing ------------------------------------------------------------------------------------------

_PINS: dict[tuple[str, str, str], str] = {}
_LISTINGS: dict[tuple[str, str, str], dict[str, int | None]] = {}
_PARTIAL: set[tuple[str, str, str]] = set()  # listings read from a snapshot folder offline: only what is cached


def repo_exists(repo: str) -> bool:
    """Whether the Hub has the model repo ``org/name`` (False offline or when the Hub cannot be asked: a repo that
    cannot be confirmed is never suggested)."""
    if _offline() or not is_repo_id(repo):
        return False

    try:
        return bool(HfApi().repo_exists(repo))
    except Exception:  # noqa: BLE001 - any failure to ask means "not confirmed"
        return False


def _pin(repo: str, revision: str) -> str:
    """The commit ``revision`` names, asked once per process (offline: the commit the cache recorded)."""
    key = (_endpoint(), repo, revision)
    if key not in _PINS:
        with _translated(repo, revision):
            _PINS[key] = HfApi().resolve_revision(repo, revision=revision).resolved
    return _PINS[key]


def _storage(repo: str) -> Path:
    return Path(_cache_dir()) / f"models--{repo.replace('/', '--')}"


def _listing(repo: str, commit: str, revision: str) -> dict[str, int | None]:
    """Every file of the repo at ``commit`` with its size: the cached tree (written by the client on any
    earlier download), else the Hub's tree, else (offline, old cache) the snapshot folder as it is."""
    key = (_endpoint(), repo, commit)
    if key in _LISTINGS:
        return _LISTINGS[key]

    files: dict[str, int | None] | None = None
    try:
        files = {f.path: f.size for f in get_cached_repo_tree(repo, revision=commit)}
    except hf.CachedRepoTreeNotFoundError:
        pass
    if files is None and not _offline():
        with _translated(repo, revision):
            files = {f.path: f.size for f in HfApi().list_repo_tree(repo, revision=commit, recursive=True)
                     if isinstance(f, HfRepoFile)}
    if files is None:
        snap = _storage(repo) / "snapshots" / commit
        if not snap.is_dir():
            _raise_offline(repo, revision)
        files = {p.relative_to(snap).as_posix(): p.stat().st_size for p in snap.rglob("*") if p.is_file()}
        _PARTIAL.add(key)
    _LISTINGS[key] = files
    return files


def _hub_choice(resolved: Resolved, patterns: tuple[str, ...]) -> list[RepoFile]:
    repo, commit = resolved.repo, resolved.commit
    assert repo is not None and commit is not None
    revision = resolved.revision or commit
    files = _listing(repo, commit, revision)
    chosen = _select(files, patterns)

    def read_index() -> Any:
        snap = _storage(repo) / "snapshots" / commit
        if _offline() and not (snap / INDEX).is_file():  # name everything the cache lacks, not just the index
            _raise_offline(repo, revision, missing=[p for p in chosen if not (snap / p).is_file()])
        return load_json(Path(_download_one(repo, commit, revision, INDEX, progress=False)))

    where = f"{repo}@{commit}"
    chosen = _prune_to_index(chosen, read_index, where)
    if (_endpoint(), repo, commit) in _PARTIAL and _wants_weights(patterns) \
            and not any(p.endswith(".safetensors") for p in chosen):
        _raise_offline(repo, revision, missing=["its *.safetensors weights"])
    _check_weights(chosen, files, patterns, where)
    snap = _storage(repo) / "snapshots" / commit
    return [RepoFile(p, files[p], (snap / p).is_file()) for p in chosen]


def _folder_choice(folder: Path, patterns: tuple[str, ...]) -> list[RepoFile]:
    files = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    chosen = _prune_to_index(_select(files, patterns), lambda: load_json(files[INDEX]),
                             str(folder))
    _check_weights(chosen, files, patterns, str(folder))
    return [RepoFile(p, files[p].stat().st_size, True) for p in chosen]


def _quiet_class() -> type:
    class Quiet(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet


def _download_one(repo: str, commit: str, revision: str, name: str, *, progress: bool) -> str:
    with _translated(repo, revision, name):
        return hf_hub_download(repo, name, revision=commit, tqdm_class=None if progress else _quiet_class())


# --- public API -----------------------------------------------------------------------------------------------

# --- publishing -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RemoteFile:
    """A file a repo holds at a revision: its size, and its content hash as the Hub reports it (the sha256 of an
    LFS file, the git blob id of any other)."""

    path: str
    size: int
    sha256: str | None
    blob_id: str


@contextmanager
def _writing(repo: str, revision: str) -> Iterator[None]:
    """Hub write failures as one paragraph each: no token or an invalid one, no write permission, no network."""
    try:
        yield
    except (ResolveError, UnsupportedModelError):
        raise
    except hf.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        at = f"{repo} (revision {revision})"
        if status == 401:
            raise RepoAccessError(f"The Hub at {_endpoint()} refused to write to {at} (HTTP 401): "
                                  + ("the token sent is not valid. " if _has_token() else "no token was sent. ")
                                  + "Set HF_TOKEN to a token with write access (huggingface.co/settings/tokens) or "
                                  "run `hf auth login`, then re-run.", repo=repo, revision=revision) from None
        if status == 403:
            raise RepoAccessError(f"The Hub refused to write to {at} (HTTP 403): the token's account cannot write "
                                  "to that namespace. Use a token with write access to it (a fine-grained token must "
                                  "list the repo), or publish under your own name.", repo=repo, revision=revision) \
                from None
        if isinstance(e, hf.RepositoryNotFoundError):
            raise RepoNotFoundError(f"Repository {repo} was not found on the Hub ({_endpoint()}) and could not be "
                                    "created. Check the repo id and that your token may create repos there.",
                                    repo=repo, revision=revision) from None
        raise UploadError(f"Uploading to {at} failed: {type(e).__name__}: {_one_line(e)}. Re-run the same command: "
                          "files the Hub already holds are not sent again.", repo=repo, revision=revision) from None
    except Exception as e:
        if isinstance(e, httpx2.HTTPError | OSError):
            raise UploadError(f"Cannot reach the Hub at {_endpoint()} to write {repo} ({type(e).__name__}: "
                              f"{_one_line(e)}). Check your network, proxy and HF_ENDPOINT, then re-run: files "
                              "already uploaded are not sent again.", repo=repo, revision=revision) from None
        raise


def remote_files(repo: str, revision: str, paths: Iterable[str]) -> dict[str, RemoteFile]:
    """What ``repo`` holds at ``revision`` of ``paths`` (empty when the repo or the revision does not exist yet).

    Raises:
        RepoAccessError, UploadError: the Hub refused or could not be reached.
    """
    with _writing(repo, revision):
        try:
            infos = HfApi().get_paths_info(repo, list(paths), revision=revision)
        except (hf.RepositoryNotFoundError, hf.RevisionNotFoundError):
            return {}
    return {i.path: RemoteFile(i.path, i.size, i.lfs.sha256 if i.lfs else None, i.blob_id)
            for i in infos if isinstance(i, HfRepoFile)}


def create_repo(repo: str, *, private: bool, revision: str) -> None:
    """The model repo ``repo`` (and the branch ``revision``), created when missing; an existing one is kept as is.

    Raises:
        RepoAccessError, RepoNotFoundError, UploadError: as :func:`remote_files`.
    """
    api = HfApi()
    with _writing(repo, revision):
        api.create_repo(repo, private=private, exist_ok=True)
        if revision != "main":
            api.create_branch(repo, branch=revision, exist_ok=True)


def commit_files(repo: str, revision: str, files: Sequence[tuple[str, Path | bytes]], message: str) -> str:
    """One commit adding ``files`` (path in the repo, local file or bytes); large files go up through LFS, which
    skips content the Hub already stores. Returns the commit.

    Raises:
        RepoAccessError, RepoNotFoundError, UploadError: as :func:`remote_files`.
    """
    ops = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(src) if isinstance(src, Path) else src)
           for name, src in files]
    with _writing(repo, revision):
        return HfApi().create_commit(repo, ops, commit_message=message, revision=revision).oid


def _split(spec: str) -> tuple[str, str]:
    repo, _, revision = spec.partition("@")
    return repo, revision or "main"


def resolve(spec: str, patterns: tuple[str, ...] = CARD_AND_CONFIG, *, progress: bool = True) -> Resolved:
    """A local folder as is; a repo id pinned to its commit, with only ``patterns`` fetched (config and card by
    default, so a pair can be judged before any weights are downloaded).

    Raises:
        InputError: neither an existing folder nor a repo id.
        ResolveError: a subclass per cause (not found, no access, unknown revision, offline, download failed).
        ConfigError: ``config.json`` was asked for and the repo has none (a GGUF-only repo, say).
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        return Resolved(path)
    if not is_repo_id(spec):
        raise InputError(f"{spec!r} is neither an existing folder nor a Hub repo id (org/name[@revision]).")
    repo, revision = _split(spec)
    commit = _pin(repo, revision)
    files = _listing(repo, commit, revision)
    if "config.json" in patterns and "config.json" not in files:
        ggufs = sorted(p for p in files if p.endswith(".gguf"))
        hint = (f" It holds GGUF files ({', '.join(ggufs[:3])}): a GGUF target goes to --target-gguf "
                f"{repo}:{ggufs[0]}, with --target naming the original safetensors repo." if ggufs else "")
        raise ConfigError(f"{repo} at revision {revision} (commit {commit}) has no config.json, so it is not a "
                          f"Hugging Face transformers checkpoint.{hint} Check the repo id.")
    return fetch(Resolved(_storage(repo) / "snapshots" / commit, repo, commit, revision), patterns, progress=progress)


def fetch(resolved: Resolved, patterns: tuple[str, ...], *, progress: bool = True) -> Resolved:
    """The files of ``resolved`` matching ``patterns``, at exactly ``resolved.commit``, in the Hub cache.

    Interrupted downloads resume: the client retries a cut connection with a Range request, and a re-run
    skips every file already complete in the cache. A local folder is returned unchanged.

    Raises:
        UnsupportedModelError: weights were asked for and the repo has none as safetensors (pickles only).
        ResolveError: a subclass per cause, as :func:`resolve` (DownloadError when a download fails).
    """
    if resolved.repo is None:
        return resolved
    repo = resolved.repo
    revision = resolved.revision or resolved.commit or "main"
    commit = resolved.commit or _pin(repo, revision)
    resolved = Resolved(_storage(repo) / "snapshots" / commit, repo, commit, revision)
    chosen = [f.path for f in _hub_choice(resolved, patterns)]
    if chosen:
        with _translated(repo, revision):
            local = Path(snapshot_download(repo, revision=commit, allow_patterns=[_literal(p) for p in chosen],
                                           tqdm_class=None if progress else _quiet_class()))
        if local.name != commit:  # the client always answers with the snapshot of the commit it was given
            raise DownloadError(f"The Hub cache returned {local} for {repo}@{commit}; expected that commit's "
                                "snapshot. Clear the repo from the cache (`hf cache delete`) and re-run.",
                                repo=repo, revision=revision)
        missing = [p for p in chosen if not (local / p).is_file()]
        if missing:
            if _offline():
                _raise_offline(repo, revision, missing=missing)
            raise DownloadError(f"Downloading {repo}@{commit} left {', '.join(missing[:4])} missing from the cache "
                                f"({local}). Re-run the same command; complete files are not downloaded again.",
                                repo=repo, revision=revision)
    return resolved


def list_files(resolved: Resolved, patterns: tuple[str, ...]) -> list[RepoFile]:
    """What ``fetch`` would download for ``patterns``, with sizes (for plans and disk checks); a local folder
    is listed from disk. May fetch ``model.safetensors.index.json`` to know which shards count.

    Raises:
        UnsupportedModelError, ResolveError: as :func:`fetch`, before any weight is downloaded.
    """
    if resolved.repo is None:
        return _folder_choice(resolved.path, patterns)
    revision = resolved.revision or resolved.commit or "main"
    commit = resolved.commit or _pin(resolved.repo, revision)
    return _hub_choice(Resolved(resolved.path, resolved.repo, commit, revision), patterns)


def safetensors_header(resolved: Resolved, name: str) -> dict[str, Any]:
    """The JSON header of one safetensors file (tensor names, dtypes, shapes and offsets, in the file's order, and its
    ``__metadata__``), never its tensor data: from the file itself for a local folder (and a file already in the Hub
    cache), else by range requests on the Hub (:func:`_range_header`: the first 100 kB, and the rest of the header only
    when it is longer).

    Raises:
        ResolveError: the Hub refused or could not be reached.
        InputError: a local file is not safetensors.
    """
    local = resolved.path / name
    if resolved.repo is None or local.is_file():
        return read_raw_header(local)[0]
    revision = resolved.revision or resolved.commit or "main"
    return _range_header(resolved.repo, resolved.commit or _pin(resolved.repo, revision), revision, name)[0]


def _range(repo: str, commit: str, revision: str, name: str, start: int, n: int) -> bytes:
    """Bytes ``start`` .. ``start + n`` of a file (fewer at its end), by one range request."""
    with _translated(repo, revision, name):
        got = get_session().get(hf_hub_url(repo, name, revision=commit), follow_redirects=True,
                                headers={**build_hf_headers(), "Range": f"bytes={start}-{start + n - 1}"})
        hf_raise_for_status(got)
    return got.content


def _range_header(repo: str, commit: str, revision: str, name: str) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and where its data starts, by range requests (the first 100 kB, then the rest of
    a longer header): what the conversion plans from while the file itself is still downloading."""
    fix = f"Its file {name} in {repo}@{commit} is not valid safetensors; check the repo."
    first = _range(repo, commit, revision, name, 0, 100_001)  # bytes=0-100000, as the Hub client asks
    n = int.from_bytes(first[:8], "little")
    if len(first) < 8 or n > MAX_HEADER:
        raise InputError(f"{repo}@{commit}: {name} declares a header of {n} bytes. {fix}")
    raw = first[8:8 + n]
    if len(raw) < n:
        raw += _range(repo, commit, revision, name, 8 + len(raw), n - len(raw))
    try:
        header = parse_bounded(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{repo}@{commit}: {name} has a corrupt header ({e}). {fix}") from None
    if not isinstance(header, dict):
        raise InputError(f"{repo}@{commit}: {name} has a corrupt header (not a JSON object). {fix}")
    return header, 8 + n


def _counting(on_bytes: Callable[[int], None]) -> type:
    """A silent progress class for the client's download loop that hands each chunk's size to ``on_bytes``."""
    class Counting(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            on_bytes(int(n or 0))
            return super().update(n)

    return Counting


def stream_shards(resolved: Resolved, names: Sequence[str], into: Path | None
                  ) -> tuple[list[StreamShard], Fetch, ReadRange]:
    """The shards ``names`` of a pinned repo, ready to stream (``arrivals.ShardStream``): each one's header read now by
    range requests, a few bytes of it on demand by the third function returned (the rows a header records before the
    shard is here), its bytes fetched later by the second, into the Hub cache as :func:`fetch` puts them
    (``into`` None: kept, so a later run reads them from disk), or into the folder ``into`` (the run's own work
    folder, never the user's Hub cache: what ``--no-keep-source`` removes once consumed). A file complete there
    already is not fetched again.

    Raises:
        ResolveError: a header could not be fetched (a subclass per cause, as :func:`resolve`).
        InputError: a header is not valid safetensors.
    """
    repo, commit = resolved.repo, resolved.commit
    assert repo is not None and commit is not None, "a local folder is read as it is"
    revision = resolved.revision or commit
    files = _listing(repo, commit, revision)
    shards = []
    for name in names:
        where = (into / name) if into is not None else resolved.path / name
        header_from = where if where.is_file() else None
        if header_from is not None:
            header, data_start, _ = read_raw_header(header_from)
        else:
            header, data_start = _range_header(repo, commit, revision, name)
        shards.append(StreamShard(name, resolved.path / name, where, header, data_start, int(files.get(name) or 0)))

    def fetch_one(shard: StreamShard, on_bytes: Callable[[int], None]) -> None:
        if shard.path.is_file() and shard.path.stat().st_size == shard.size:
            return
        with _translated(repo, revision, shard.name):
            got = Path(hf_hub_download(repo, shard.name, revision=commit, tqdm_class=_counting(on_bytes),
                                       local_dir=into))
        if got.resolve() != shard.path.resolve():
            raise DownloadError(f"The Hub client put {shard.name} of {repo}@{commit} at {got}, not {shard.path}. "
                                "Re-run the same command.", repo=repo, revision=revision)

    def read_range(shard: StreamShard, start: int, n: int) -> bytes:
        got = _range(repo, commit, revision, shard.name, start, n)
        if len(got) != n:
            raise DownloadError(f"The Hub sent {len(got)} of {n} bytes at {start} of {shard.name} in {repo}@{commit}. "
                                "Re-run the same command.", repo=repo, revision=revision)
        return got

    return shards, fetch_one, read_range


def fetch_file(spec: str, *, progress: bool = True) -> FetchedFile:
    """``org/name[@revision]:path/in/repo`` (say a GGUF for ``--target-gguf``) or a local file -> a local file.

    Raises:
        InputError: neither an existing file nor ``REPO[@rev]:FILE``.
        ResolveError: as :func:`resolve`; RepoNotFoundError when the repo lacks the file.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        return FetchedFile(path)
    m = FILE_SPEC.match(spec)
    if m is None or spec.startswith((".", "/", "~")):
        kind = "a folder, not a file" if path.is_dir() else "neither an existing file nor a Hub file spec"
        raise InputError(f"{spec!r} is {kind}. Give a file path or org/name[@revision]:path/in/repo, e.g. "
                         "org/name:model-Q8_0.gguf.")
    repo, revision, name = m["repo"], m["rev"] or "main", m["file"]
    commit = _pin(repo, revision)
    files = _listing(repo, commit, revision)
    if name not in files:
        near = sorted(p for p in files if p.endswith(Path(name).suffix or ".gguf"))
        hint = f" Files of that kind there: {', '.join(near[:8])}." if near else ""
        raise RepoNotFoundError(f"{name} is not in {repo} at revision {revision} (commit {commit}).{hint} Check "
                                f"the file name against {_endpoint()}/{repo}/tree/{revision}.",
                                repo=repo, revision=revision)
    shards = split_siblings(Path(name))  # a split GGUF named by its first shard: every shard, as -hf fetches them
    if shards is not None and shards[0].name == Path(name).name:
        names = [str(Path(name).with_name(p.name)) for p in shards]
        if missing := [n for n in names if n not in files]:
            raise RepoNotFoundError(f"{name} is the first of {len(names)} shards, but {', '.join(missing[:3])} "
                                    f"{'is' if len(missing) == 1 else 'are'} not in {repo} at commit {commit}. "
                                    "The split is incomplete there; ask its publisher, or pick another file.",
                                    repo=repo, revision=revision)
        for later in names[1:]:
            _download_one(repo, commit, revision, later, progress=progress)
    return FetchedFile(Path(_download_one(repo, commit, revision, name, progress=progress)), repo, commit, name)
