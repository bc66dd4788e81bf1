"""What every Click command shares: error -> exit code mapping, JSON output, logging, progress bars."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from ..errors import DflashGgufError

log = logging.getLogger("dflash_gguf")


# Options every command spells the same way.
json_option = click.option("--json", "json_", is_flag=True, help="Print one JSON document on stdout.")
verbose_option = click.option("-v", "--verbose", is_flag=True, help="Log each step on stderr.")


def split_options(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--split-max-size`` and ``--split-max-tensors`` for a command that writes ``what`` (read them with
    ``SplitRule.from_flags``)."""
    size = click.option("--split-max-size", default=None, metavar="SIZE",
                        help=f"Write {what} in shards of at most SIZE of tensors (K, M, G = 1000s, as llama.cpp's "
                             "converter reads it; e.g. 48G under the Hub's per-file limit), named "
                             "-00001-of-0000N.gguf ..., byte for byte as llama.cpp b11434 writes them "
                             "(llama-gguf-split --split; convert_hf_to_gguf.py for an unquantized target of the "
                             "pipeline). One that fits stays one file.")
    tensors = click.option("--split-max-tensors", type=click.IntRange(min=1), default=None, metavar="N",
                           help=f"Write {what} in shards of at most N tensors (as llama-gguf-split).")
    return lambda fn: size(tensors(fn))


def imatrix_options(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--imatrix FILE|auto`` and the calibration of ``auto`` (``--calibration``, ``--calibration-ctx``,
    ``--calibration-chunks``) for a command that quantizes ``what``; read them with :func:`imatrix_choice`."""
    imatrix = click.option("--imatrix", default=None, metavar="FILE|auto",
                           help=f"An importance matrix for {what}: llama-imatrix's output (GGUF or legacy .dat), "
                                "checked against the model (exit 24 for another model's) and passed to "
                                "llama-quantize by name; or auto: made with b11434's llama-imatrix from the 16-bit "
                                "model over --calibration. IQ1/IQ2/IQ3_XXS and Q2_K_S need one.")
    text = click.option("--calibration", default=None, metavar="TEXT|REPO[@REV]:FILE",
                        help="With --imatrix auto: the calibration text, a file or one from the Hub at a commit.")
    ctx = click.option("--calibration-ctx", type=click.IntRange(min=8), default=None, metavar="N",
                       help="With --imatrix auto: llama-imatrix's context (-c), tokens per chunk (default 512, "
                            "llama-imatrix's own).")
    chunks = click.option("--calibration-chunks", type=click.IntRange(min=1), default=None, metavar="N",
                          help="With --imatrix auto: at most N chunks of the text (llama-imatrix --chunks; default "
                               "all).")
    return lambda fn: imatrix(text(ctx(chunks(fn))))


def recipe_options(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--tensor-type PATTERN=TYPE`` (repeatable) and ``--tensor-type-file FILE`` for a command that quantizes
    ``what``; read them with :func:`dflash_gguf.quantize.recipes.recipe_from_flags`."""
    rule = click.option("--tensor-type", "tensor_type", multiple=True, metavar="PATTERN=TYPE",
                        help=f"A per-tensor type for {what}, as llama-quantize's flag: the first PATTERN (a regular "
                             "expression, lowercased) found in a tensor's name gives its TYPE instead of the mixture "
                             r"rules, e.g. 'attn_v=q8_0' or 'blk\.(1[0-9]|2[0-3])\.ffn_down=q6_k'. Repeatable, "
                             "in order; a rule no tensor takes is reported.")
    file = click.option("--tensor-type-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
                        metavar="FILE", help="PATTERN=TYPE rules separated by whitespace, as llama-quantize's "
                                             "flag; they follow the --tensor-type rules.")
    return lambda fn: rule(file(fn))


def imatrix_choice(imatrix: str | None, calibration: str | None) -> tuple[Path | None, bool]:
    """(the --imatrix file or None, whether it is made: auto), checked against --calibration.

    Raises:
        click.UsageError: --calibration without --imatrix auto, or auto without --calibration.
    """
    auto = imatrix is not None and imatrix.lower() == "auto"
    if calibration is not None and not auto:
        raise click.UsageError("--calibration is the text --imatrix auto computes the matrix over: add --imatrix "
                               "auto, or drop --calibration.")
    if auto and calibration is None:
        raise click.UsageError("--imatrix auto needs --calibration TEXT (a text file, or REPO[@REV]:FILE from the "
                               "Hub): llama-imatrix measures the activations on it.")
    return (Path(imatrix) if imatrix is not None and not auto else None), auto


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format=("%(asctime)s " if verbose else "") + "%(levelname)s %(name)s: %(message)s")


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, docker stop, systemd, a CI timeout), unwound exactly as Ctrl-C is: partial outputs are
    removed and child processes stopped on the way out."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn our exceptions into one-paragraph messages and the exit code their class names; Ctrl-C exits 130 and
    SIGTERM 143 (128 + the signal), each with nothing left behind."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _sigterm_as_interrupt():
                return fn(*args, **kwargs)
        except DflashGgufError as e:
            if os.environ.get("DFLASH_GGUF_TRACEBACK"):
                raise
            click.echo(f"Error: {e}", err=True)
            sys.exit(e.exit_code)
        except Terminated:
            click.echo("Terminated; no output was left behind.", err=True)
            sys.exit(128 + signal.SIGTERM)
        except KeyboardInterrupt:
            click.echo("Interrupted; no output was left behind.", err=True)
            sys.exit(130)
    return wrapper


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


class Progress:
    """A progress bar on stderr, hidden when stderr is not a terminal: bytes by default, or counted ``unit`` s
    with the current item's label beside the count. Called as the stages' progress callbacks."""

    def __init__(self, desc: str, unit: str = "B", label_width: int = 40) -> None:
        self.bar = tqdm(desc=desc, total=0, unit=unit, unit_scale=unit == "B", file=sys.stderr, disable=None,
                        leave=False)
        self.label_width = label_width

    def __call__(self, done: int, total: int, label: str | None = None) -> None:
        self.bar.total = total
        self.bar.n = done
        if label is not None:
            self.bar.set_postfix_str(label[:self.label_width])
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def echo_conversion(result: Any, json_: bool) -> None:
    """A converter's result (``convert.result.ConvertResult``): one JSON document, or a line plus its notes."""
    if json_:
        echo_json(result.to_dict())
        return
    verb = "would write" if result.dry_run else "wrote"
    click.echo(f"{verb} {result.outfile}: {result.n_tensors} tensors, {result.n_bytes / 1e6:.1f} MB, "
               f"{result.outtype}, vocab {result.vocab.model} ({result.vocab.n_tokens} tokens) "
               f"in {result.seconds:.2f} s")
    for note in result.notes:
        click.echo(f"note: {note}")
