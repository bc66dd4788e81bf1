"""Click commands only: parse options, call a stage, print, map errors to exit codes.

``dflash-convert`` and ``dflash-verify`` are the two front doors; ``dflash-gguf`` groups every command.
One module per command; ``_common`` holds the error -> exit code mapping, JSON output and progress bars.
Set ``DFLASH_GGUF_TRACEBACK=1`` to see the traceback behind an error.
"""

from __future__ import annotations

import click

from .. import __version__
from .convert import convert_cmd
from .convert_target import convert_target_cmd
from .publish import publish_cmd
from .quality import quality_cmd
from .quantize import quantize_cmd
from .tokenizer import fix_tokenizer_cmd
from .tune import tune_cmd
from .verify import precheck_cmd, verify_cmd


@click.group()
@click.version_option(__version__, prog_name="dflash-gguf")
def main() -> None:
    """dflash-gguf: DFlash drafter + target from Hugging Face to a llama.cpp GGUF pair."""


for command in (convert_cmd, verify_cmd, precheck_cmd, quantize_cmd, fix_tokenizer_cmd, convert_target_cmd, tune_cmd,
                publish_cmd, quality_cmd):
    main.add_command(command)


def convert_main() -> None:
    """Entry point of ``dflash-convert``."""
    convert_cmd(prog_name="dflash-convert")


def verify_main() -> None:
    """Entry point of ``dflash-verify``."""
    verify_cmd(prog_name="dflash-verify")
