"""Click commands only: parse options, call a stage, print, map errors to exit codes.

``dflash-convert`` and ``dflash-verify`` are the two front doors; ``dflash-gguf`` groups every command.
One module per command; ``_common`` holds the error -> exit code mapping, JSON output and progress bars.
Set ``DFLASH_GGUF_TRACEBACK=1`` to see the traceback behind an error.
"""

from __future__ import annotations

import importlib
import os

# Before numpy loads: the tool's only matrix products are small (the lineage fingerprint), while the quantizer keeps
# every core busy; OpenBLAS's own threads would only spin beside it. A user's setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click  # noqa: E402

from .. import __version__  # noqa: E402

# name -> (module, attribute): a command's module is imported when the command runs (or help lists it), so that
# `dflash-gguf convert-target` does not pay for the Hub client, the pipeline and the drafter families at start-up
_COMMANDS = {
    "convert": ("convert", "convert_cmd"),
    "verify": ("verify", "verify_cmd"),
    "precheck": ("verify", "precheck_cmd"),
    "quantize": ("quantize", "quantize_cmd"),
    "fix-tokenizer": ("tokenizer", "fix_tokenizer_cmd"),
    "convert-target": ("convert_target", "convert_target_cmd"),
    "tune": ("tune", "tune_cmd"),
    "publish": ("publish", "publish_cmd"),
    "quality": ("quality", "quality_cmd"),
    "forecast": ("forecast", "forecast_cmd"),
}


def command(name: str) -> click.Command:
    """The command ``dflash-gguf NAME`` runs."""
    module, attr = _COMMANDS[name]
    found: click.Command = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    return found


class _LazyGroup(click.Group):
    """A group whose commands are imported on first use (click's documented lazy-loading pattern)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return command(cmd_name) if cmd_name in _COMMANDS else None


@click.group(cls=_LazyGroup)
@click.version_option(__version__, prog_name="dflash-gguf")
def main() -> None:
    """dflash-gguf: DFlash drafter + target from Hugging Face to a llama.cpp GGUF pair."""


def convert_main() -> None:
    """Entry point of ``dflash-convert``."""
    command("convert")(prog_name="dflash-convert")


def verify_main() -> None:
    """Entry point of ``dflash-verify``."""
    command("verify")(prog_name="dflash-verify")
