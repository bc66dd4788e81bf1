"""The end of every conversion (drafter and target alike): the provenance record, then the planned GGUF
written, quantized in one pass, or only sized, and what the conversion returns.

Writing is the same for every converter: size the file, check free space, stream the tensors into
``<out>.partial`` with byte progress, fsync and rename (``atomic.atomic_output``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import LLAMA_CPP_BUILD, __version__, arrivals, jsonfile
from .. import fingerprint as efp
from .. import provenance as prov
from ..atomic import atomic_output, check_free_space
from ..errors import InputError, TensorError
from ..ggufio import GGUFPlan, TensorOut, Written
from ..model_card import base_models
from ..quantize.builtin import NO_OVERRIDES, Overrides, QuantOutput, quantize_plan
from ..quantize.imatrix import Importance, check_entries
from .safetensors import index_checkpoint
from .tensor_io import to_f32
from .vocab import VocabInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConvertResult:
    outfile: Path
    n_tensors: int
    n_bytes: int
    outtype: str
    vocab: VocabInfo
    notes: tuple[str, ...]
    seconds: float
    dry_run: bool = False
    provenance: dict[str, str] = field(default_factory=dict)
    sha256: str | None = None  # of the file written, hashed while writing (None for a dry run)
    more_sha256: tuple[str | None, ...] = ()  # of each further output of the same pass (``finish``'s ``more``)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready description for ``--json``."""
        return {"outfile": str(self.outfile), "tensors": self.n_tensors, "bytes": self.n_bytes,
                "outtype": self.outtype, "vocab": {"model": self.vocab.model, "tokens": self.vocab.n_tokens,
                "sha256": self.vocab.sha256}, "notes": list(self.notes), "seconds": round(self.seconds, 3),
                "dry_run": self.dry_run, "provenance": self.provenance}


def write_plan(plan: GGUFPlan, outfile: Path, on_progress: Callable[[int, int], None] | None = None) -> Written:
    """Write ``plan`` atomically to ``outfile``; return the file size and its sha256 (hashed while writing).

    Raises:
        OutputError: the folder is missing, there is not enough free space, or the disk fills up.
    """
    outfile = Path(outfile)
    header = plan.header_bytes()
    total = plan.data_bytes
    check_free_space(outfile, total + len(header))
    done = 0

    def tick(t: TensorOut) -> None:
        nonlocal done
        done += t.nbytes
        if on_progress is not None:
            on_progress(done, total)

    with atomic_output(outfile) as tmp:
        written = plan.write_hashed(tmp, on_tensor=tick, header=header)
    log.info("wrote %s: %d tensors, %d bytes", outfile, len(plan.tensors), written.n_bytes)
    return written


_EMBED_NAMES = ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight",
                "language_model.model.embed_tokens.weight", "embed_tokens.weight")


def target_embedding_fingerprint(target_dir: Path) -> str | None:
    """Fingerprint of the target's token embedding, reading only the sampled rows; None without weights.

    Recorded so dflash-verify can later tell the target a file was converted against from a QAT or
    re-trained one with the same config and tokenizer (see dflash_gguf/fingerprint.py).
    """
    try:
        refs = index_checkpoint(target_dir)
    except (TensorError, InputError):
        return None
    ref = next((refs[n] for n in _EMBED_NAMES if n in refs), None)
    if ref is None or len(ref.shape) != 2 or ref.dtype not in ("BF16", "F16", "F32"):
        return None
    n_vocab, n_embd = ref.shape
    row_bytes = ref.nbytes // n_vocab
    ids = efp.sample_rows(n_vocab)
    ranges = [(ref.offset + i * row_bytes, row_bytes) for i in ids]
    # the header carries it: a shard still streaming in gives its sampled rows by range requests
    if (parts := arrivals.read_ranges(ref.path, ranges)) is not None:
        raw = b"".join(parts)
    else:
        with open(ref.path, "rb", buffering=0) as f:
            raw = b"".join(os.pread(f.fileno(), n, offset) for offset, n in ranges)
    return efp.encode(efp.compute(to_f32(raw, ref.dtype).reshape(len(ids), n_embd), n_vocab))


def drafter_card_record(drafter_dir: Path) -> dict[str, str]:
    """The drafter card's first ``base_model`` as our key (llama.cpp's converter copies it into
    ``general.base_model.*``; our general keys differ, so verify reads it from here)."""
    found = base_models(drafter_dir)
    return {prov.DRAFTER_BASE_MODEL: found[0]} if found else {}


def target_record(target_dir: Path, config_path: Path, arch: str, vocab_sha256: str,
                  known: dict[str, str] | None) -> dict[str, str]:
    """Our provenance keys about the target (both converters write them); ``known`` (what the caller knows,
    ``provenance.Provenance.keys()``) wins over these defaults."""
    return {
        prov.CONVERTER: f"dflash-gguf {__version__}",
        prov.LLAMA_CPP_BUILD: LLAMA_CPP_BUILD,
        prov.TARGET_SOURCE: prov.folder_label(target_dir),
        prov.TARGET_ARCH: arch,
        prov.TARGET_CONFIG_SHA256: hashlib.sha256(Path(config_path).read_bytes()).hexdigest(),
        prov.TARGET_VOCAB_SHA256: vocab_sha256,
        prov.TOKENIZER_ORIGIN: "original",
        **({prov.TARGET_EMBD_FINGERPRINT: fp} if (fp := (known or {}).get(prov.TARGET_EMBD_FINGERPRINT)
                                                   or target_embedding_fingerprint(target_dir)) else {}),
        **(known or {}),
    }


def finish(plan: GGUFPlan, outfile: Path, outtype: str, vocab: VocabInfo, notes: tuple[str, ...],
           recorded: dict[str, str], started: float, *, quant: str | None = None, dry_run: bool = False,
           on_progress: Callable[[int, int], None] | None = None,
           more: Sequence[QuantOutput] = (), importance: Importance | None = None,
           overrides: Overrides = NO_OVERRIDES) -> ConvertResult:
    """Write ``recorded`` and ``notes`` as our keys, then write ``plan`` (or quantize it to ``quant`` in one
    pass, and to each further (file, type) of ``more`` from the same read, with the ``importance`` matrix when
    given, checked against the plan's tensors first, and llama-quantize's per-tensor ``overrides``; or with
    ``dry_run`` only size it).

    Raises:
        OutputError, QuantizeError: as :func:`write_plan` and ``quantize.builtin.quantize_plan``.
    """
    jsonfile.forget()  # the plan holds all it needs: drop the parsed tokenizer.json (~130 MB at 262k tokens)
    for name, value in recorded.items():
        plan.add_string(prov.key(name), value)
    if notes:
        plan.add_array(prov.key(prov.NOTES), list(notes))
    outfile = Path(outfile)
    sha256: str | None = None
    more_sha256: tuple[str | None, ...] = ()
    if quant is not None:
        if importance is not None:
            check_entries({n: w.size for n, w in importance.weights.items()},
                          {t.name: t.ne for t in plan.tensors}, importance.file, outfile.name)
        outcome, *others = quantize_plan(plan, outfile, quant, dry_run=dry_run, on_progress=on_progress, more=more,
                                         importance=importance, overrides=overrides)
        size, sha256, more_sha256 = outcome.n_bytes, outcome.sha256, tuple(o.sha256 for o in others)
        outtype = quant
    elif more:
        raise AssertionError("further outputs are quantized in the same pass: a type for the first is needed")
    elif dry_run:
        size = plan.data_bytes
    else:
        written = write_plan(plan, outfile, on_progress)
        size, sha256 = written.n_bytes, written.sha256
    return ConvertResult(outfile, len(plan.tensors), size, outtype, vocab, notes, time.perf_counter() - started,
                         dry_run, recorded, sha256, more_sha256)
