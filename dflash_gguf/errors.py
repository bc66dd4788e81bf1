"""Every exception a user can see, each with a message that says what, where and what to do.

Stages raise these; each class carries its ``exit_code``, and only the CLI layer
(``cli/_common.handle_errors``) turns an error into a message and that exit code.
"""

from __future__ import annotations


class DflashGgufError(Exception):
    """Base of all errors meant for a human. ``str(err)`` is the one-paragraph message."""

    exit_code = 1


class InputError(DflashGgufError):
    """An input file cannot be read at all (missing, truncated, not the format it claims)."""

    exit_code = 2


class ConfigError(DflashGgufError):
    """A config.json is missing, unparsable, or lacks a field conversion needs."""

    exit_code = 3


class UnsupportedModelError(DflashGgufError):
    """The checkpoint is valid but of a kind llama.cpp b11434 cannot load or serve."""

    exit_code = 4


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


# A file under verification that cannot be read is an input error like any other (exit 2).
VerifyError = InputError


class ResolveError(DflashGgufError):
    """A repo id or revision cannot be resolved or fetched."""

    exit_code = 9


class OutputError(DflashGgufError):
    """The output cannot be written (exists, no space, not writable)."""

    exit_code = 10
