"""Every exception a user can see, each with a message that says what, where and what to do.

Stages raise these; each class carries its ``exit_code``, and only the CLI layer
(``cli/_common.handle_errors``) turns an error into a message and that exit code.
"""

from __future__ import annotations

import json


class DflashGgufError(Exception):
    """Base of all errors meant for a human. ``str(err)`` is the one-paragraph message."""

    exit_code = 1


class InputError(DflashGgufError):
    """An input file cannot be read at all (missing, truncated, not the format it claims)."""

    exit_code = 2


class UnreadableJson(InputError, json.JSONDecodeError):
    """A JSON file of a repo, folder or manifest that is not JSON, not UTF-8, or outside the readers' bounds.

    Also a ``json.JSONDecodeError``, so a stage that reads the file with its own message keeps it; anywhere else
    it reaches the CLI as the unreadable-input error it is, naming the file."""

    def __init__(self, path: object, reason: str) -> None:
        json.JSONDecodeError.__init__(self, reason, "", 0)
        self.reason = reason  # what is wrong, without the file: for a stage that words its own message
        self.message = (f"{path} cannot be read as JSON: {reason}. Re-download it, or restore the file the model's "
                        "repository ships.")

    def __str__(self) -> str:
        return self.message


class ConfigError(DflashGgufError):
    """A config.json is missing, unparsable, or lacks a field conversion needs."""

    exit_code = 3


class UnsupportedModelError(DflashGgufError):
    """The checkpoint is valid but of a kind llama.cpp b11434 cannot load or serve."""

    exit_code = 4


class NotCoveredError(UnsupportedModelError):
    """llama.cpp b11434 converts and serves it, but the built-in converter does not mirror that path: the message
    names llama.cpp's own converter (the pipeline's ``--llama-cpp DIR``) as the way."""

    exit_code = 18


class TensorError(DflashGgufError):
    """Tensors missing, unexpected, unmappable, or of the wrong shape."""

    exit_code = 5


class IncompatiblePairError(DflashGgufError):
    """Drafter and target do not belong together (hidden size, taps, vocabulary, lineage)."""

    exit_code = 6


class TokenizerError(DflashGgufError):
    """The target's tokenizer files are missing, corrupt, or disagree with each other."""

    exit_code = 7


class QuantizeError(DflashGgufError):
    """Quantization was refused or failed."""

    exit_code = 8


class ImatrixMismatch(QuantizeError):
    """An importance matrix made for another model than the one to quantize."""

    exit_code = 24


class ResolveError(DflashGgufError):
    """A repo id or revision cannot be resolved or fetched."""

    exit_code = 9


class OutputError(DflashGgufError):
    """The output cannot be written (exists, no space, not writable)."""

    exit_code = 10


# Hub failures: one class per thing the user does differently to fix it (all are ResolveErrors).
class HubError(ResolveError):
    """A Hub request failed; ``repo`` and ``revision`` say for what (also named in the message)."""

    def __init__(self, message: str, *, repo: str | None = None, revision: str | None = None) -> None:
        super().__init__(message)
        self.repo, self.revision = repo, revision


class RepoNotFoundError(HubError):
    """The repo (or a file asked for in it) does not exist, or is private and no token can read it."""

    exit_code = 9


class RepoAccessError(HubError):
    """The Hub refused access: a gated repo not granted, a token without read permission (403), an invalid token."""

    exit_code = 11


class RevisionNotFoundError(HubError):
    """The repo exists but the branch, tag or commit asked for does not."""

    exit_code = 12


class HubOfflineError(HubError):
    """The Hub cannot be reached (HF_HUB_OFFLINE or no network) and the cache has no complete copy."""

    exit_code = 13


class DownloadError(HubError):
    """A download started but did not complete (connection cut for good, server error, disk full)."""

    exit_code = 14


class UploadError(HubError):
    """An upload to the Hub started but did not complete (connection cut, server error)."""

    exit_code = 20


class PublishRefused(DflashGgufError):
    """``publish`` will not put the folder on the Hub as it is: verify refuses the pair, a file is not the one
    pair.json records, or the card's license cannot be told."""

    exit_code = 21


class PrivateDataRefused(PublishRefused):
    """``publish`` found a path, the user name or the host name of this machine in a file it was about to upload
    (the files and fields are named); nothing was uploaded."""

    exit_code = 22


class FileTooLargeRefused(PublishRefused):
    """``publish`` found a file above the Hub's per-file limit (``--max-file-size``); nothing was uploaded, and the
    message names --split-max-size."""

    exit_code = 23


class FolderBusyError(DflashGgufError):
    """Another dflash-gguf run is writing the same output folder (its pid and start time are named)."""

    exit_code = 19


class LlamaServerNotFound(DflashGgufError):
    """``tune`` needs llama.cpp's llama-server and none was found (or the one named is not executable)."""

    exit_code = 16


class TuneError(DflashGgufError):
    """Nothing could be measured: the target alone could not be served, or the inputs name no pair."""

    exit_code = 17


# Not an error: the exit code of a measurement whose verdict is that draft acceptance collapsed (the pair runs,
# and the drafter's tokens are almost never kept: a drafter trained on another model). ``tune`` and
# ``dflash-convert --tune`` exit with it.
ACCEPTANCE_COLLAPSED = 15


class UnsafePickleError(InputError):
    """The pickle names a global outside the tensor-rebuild set."""


class ServerFailed(DflashGgufError):
    """One configuration's server crashed, refused its model, or hung; the message quotes its log."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind  # "crashed" | "timeout" | "refused"


class PlotUnavailable(DflashGgufError):
    """Matplotlib is not installed; the message says how to get the picture."""
