"""The tokenizer stage: check a target's tokenizer.model, repair it in an overlay dir, vet a donor.

Never writes into the target dir or the Hugging Face cache: other runs, and other tools, share those
files. The repaired ``tokenizer.model`` goes into an overlay dir that mirrors the target (small files
copied, large ones symlinked), which ``convert_drafter(..., tokenizer_dir=overlay)`` and any
SentencePiece tool can read in place of the snapshot.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import constants as hf_constants

from .. import provenance as prov
from ..errors import ConfigError, HubError, InputError, OutputError, ResolveError, TokenizerError
from ..jsonfile import read_json
from .compare import PieceDiff, diff_pieces, load_model_pieces, read_model_file
from .synthesize import synthesize_tokenizer_model, tokenizer_json_pieces

log = logging.getLogger(__name__)

OVERLAY_MARKER = ".dflash_gguf_overlay.json"  # marks a dir we may replace on the next run
COPY_LIMIT = 64 * 2**20  # files up to this size are copied into the overlay, larger ones symlinked


@dataclass(frozen=True)
class FixResult:
    """What the stage found and did; ``provenance()`` feeds ``convert_drafter``."""

    target: Path
    n_tokens: int
    config_vocab_size: int | None
    existing: str  # "missing" | "matches" | "foreign" | "corrupt"
    existing_diff: PieceDiff | None
    donor: str | None  # PATH or REPO@COMMIT
    donor_diff: PieceDiff | None
    origin: str  # "original" | "synthesized" | "donor PATH-or-REPO@COMMIT"
    overlay: Path | None  # None: nothing written (no --out, or nothing to repair)
    model_sha256: str | None  # of the tokenizer.model the overlay (would) hold
    notes: tuple[str, ...] = field(default_factory=tuple)

    def provenance(self) -> dict[str, str]:
        out = {prov.TOKENIZER_ORIGIN: self.origin}
        if self.model_sha256:
            out[prov.TOKENIZER_MODEL_SHA256] = self.model_sha256
        return out

    def to_dict(self) -> dict[str, Any]:
        def d(diff: PieceDiff | None, label: str) -> dict[str, Any] | None:
            if diff is None:
                return None
            return {"matches": diff.matches, "differing_ids": diff.n_differing, "model_pieces": diff.n_model,
                    "json_tokens": diff.n_json, "first": diff.lines(label)}

        return {"target": str(self.target), "tokenizer_json_tokens": self.n_tokens,
                "config_vocab_size": self.config_vocab_size, "existing_tokenizer_model": self.existing,
                "existing_diff": d(self.existing_diff, "existing"), "donor": self.donor,
                "donor_diff": d(self.donor_diff, "donor"), "origin": self.origin,
                "overlay": str(self.overlay) if self.overlay else None, "tokenizer_model_sha256": self.model_sha256,
                "provenance": self.provenance(), "notes": list(self.notes)}


def _config_vocab_size(target: Path) -> int | None:
    path = target / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = read_json(path)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is corrupt ({e!r}). Re-download it.") from None
    value = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(value) if isinstance(value, int) else None


def check_vocab_size(target: Path, n_tokens: int) -> tuple[int | None, list[str]]:
    """config.json's vocab_size counts embedding rows (Gemma-4: 262144; Qwen pads past its tokenizer), so
    a tokenizer *smaller* than it is fine (llama.cpp trims or pads the rows); a larger one is not.

    Raises:
        TokenizerError: tokenizer.json has ids beyond the embedding table.
    """
    size = _config_vocab_size(target)
    if size is None:
        return None, [f"{target / 'config.json'} gives no vocab_size; tokenizer size not cross-checked"]
    if n_tokens > size:
        raise TokenizerError(
            f"{target / 'tokenizer.json'} has {n_tokens} tokens but {target / 'config.json'} vocab_size is {size} "
            "(embedding rows): ids past the table cannot be embedded, so this tokenizer.json belongs to another "
            "model. Re-download the target's tokenizer.json."
        )
    if n_tokens < size:
        return size, [f"config.json vocab_size {size} exceeds the {n_tokens} tokenizer tokens (padding rows)"]
    return size, []


def resolve_donor(spec: str) -> tuple[bytes, str]:
    """A donor tokenizer.model as (bytes, label): a local file/dir, else a Hub ``REPO[@REVISION]``.

    Raises:
        InputError: a path that does not exist and is not a repo id.
        ResolveError: the Hub download failed.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.model"
    if path.exists():
        return read_model_file(path), str(path.resolve())
    from ..hub import is_repo_id, resolve  # here: the Hub client is only needed for a donor on the Hub

    if spec.endswith(".model") or not is_repo_id(spec):
        raise InputError(f"Donor {spec!r} is neither an existing file nor a Hub repo id (owner/name[@revision]). "
                         "Check the path.")
    try:
        fetched = resolve(spec, ("tokenizer.model",))
    except HubError as e:  # same class, so the exit code still says what went wrong (missing, gated, ...)
        raise type(e)(f"Cannot fetch tokenizer.model from {spec}: {e} Or pass a local file as --donor.",
                      repo=e.repo, revision=e.revision) from None
    except ResolveError as e:
        raise ResolveError(f"Cannot fetch tokenizer.model from {spec}: {e} Or pass a local file as --donor.") \
            from None
    local = fetched.path / "tokenizer.model"
    if not local.is_file():
        raise ResolveError(f"Cannot fetch tokenizer.model from {spec}: {fetched.label} has no tokenizer.model. "
                           "Pass a repo or local file that has one as --donor.")
    return read_model_file(local), f"{fetched.repo}@{fetched.commit}"


def overlay_provenance(overlay: Path) -> dict[str, str]:
    """The provenance keys an overlay written by :func:`fix_tokenizer` records ({} for any other dir)."""
    marker = Path(overlay) / OVERLAY_MARKER
    if not marker.is_file():
        return {}
    record = read_json(marker)
    return {k: str(v) for k, v in record.items() if k.startswith("tokenizer.") and v is not None}


def _guard_overlay(target: Path, out: Path) -> None:
    real_out, real_target = out.resolve(), target.resolve()
    if real_out == real_target or real_target in real_out.parents or real_out in real_target.parents:
        raise OutputError(f"Overlay dir {out} overlaps the target dir {target}; the target must stay untouched. "
                          "Choose an --out outside it.")
    cache = hf_constants.HF_HUB_CACHE  # read now: HF_HOME may be set after import
    if Path(cache).resolve() in (real_out, *real_out.parents):
        raise OutputError(f"Overlay dir {out} is inside the Hugging Face cache {cache}, which must stay "
                          "untouched. Choose an --out outside it.")
    if not out.parent.is_dir():
        raise OutputError(f"Folder {out.parent} does not exist. Create it or choose another --out.")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / OVERLAY_MARKER).is_file())):
        raise OutputError(f"{out} exists and is not an overlay dflash-gguf wrote. Delete it or choose another --out.")


def write_overlay(target: Path, out: Path, model: bytes | None, record: dict[str, Any]) -> tuple[int, int]:
    """Mirror ``target`` into ``out`` (atomically: built as ``out.partial``, then renamed), with ``model``
    as its tokenizer.model when given. Returns (files copied, files symlinked).

    Raises:
        OutputError: ``out`` overlaps the target or the HF cache, or is someone else's dir.
    """
    target, out = Path(target), Path(out).absolute()
    _guard_overlay(target, out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    copied = linked = 0
    try:
        tmp.mkdir()
        for src in sorted(target.iterdir()):
            if src.name.startswith(".") or (model is not None and src.name == "tokenizer.model"):
                continue
            real = src.resolve()  # HF snapshots hold symlinks into blobs/: point at the blob itself
            if real.is_file() and real.stat().st_size <= COPY_LIMIT:
                shutil.copyfile(real, tmp / src.name)
                copied += 1
            else:
                os.symlink(real, tmp / src.name)
                linked += 1
        if model is not None:
            with open(tmp / "tokenizer.model", "wb") as f:
                f.write(model)
                f.flush()
                os.fsync(f.fileno())
        (tmp / OVERLAY_MARKER).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return copied, linked


def fix_tokenizer(target: Path, *, donor: str | None = None, force_donor: bool = False, repair: bool = False,
                  out: Path | None = None) -> FixResult:
    """Check the target's tokenizer.model against tokenizer.json and, with ``out``, write an overlay
    holding a correct one (the donor's if it matches, else one synthesized from tokenizer.json).

    Raises:
        InputError: target dir missing.
        TokenizerError: corrupt files, a vocab size past config.json's, a refused donor, or a foreign
            tokenizer.model in the target without ``repair``.
        ResolveError: the donor cannot be fetched.
        OutputError: ``out`` is unsafe to write.
    """
    target = Path(target)
    if not target.is_dir():
        raise InputError(f"Target {target} is not a directory. Pass the target model's local folder or snapshot.")
    json_pieces = tokenizer_json_pieces(target / "tokenizer.json")
    vocab_size, notes = check_vocab_size(target, len(json_pieces))
    if out is not None:
        _guard_overlay(target, Path(out).absolute())  # fail before any download or synthesis

    existing, existing_diff = "missing", None
    if (target / "tokenizer.model").exists():
        try:
            pieces = load_model_pieces(read_model_file(target / "tokenizer.model"), str(target / "tokenizer.model"))
        except TokenizerError:
            if not repair:
                raise
            existing = "corrupt"
            notes.append("the target's tokenizer.model is corrupt; replaced in the overlay (--repair)")
        else:
            existing_diff = diff_pieces(pieces, json_pieces)
            existing = "matches" if existing_diff.matches else "foreign"

    donor_label = donor_diff = None
    model: bytes | None = None
    if donor is not None:
        donor_bytes, donor_label = resolve_donor(donor)
        donor_diff = diff_pieces(load_model_pieces(donor_bytes, f"donor {donor_label}"), json_pieces)
        if not donor_diff.matches and not force_donor:
            raise TokenizerError(
                f"tokenizer.model from {donor_label} does not match {target / 'tokenizer.json'}: "
                f"{donor_diff.summary('donor')}. Refusing to use it: chat and stop tokens would silently diverge. "
                "Omit --donor to synthesize a matching tokenizer.model, or pass --force-donor to use it anyway."
            )
        if not donor_diff.matches:
            notes.append(f"donor used despite {donor_diff.n_differing} differing ids (--force-donor)")
        model, origin = donor_bytes, f"donor {donor_label}"
    elif existing == "matches":
        origin = "original"
    elif existing == "foreign" and not repair:
        assert existing_diff is not None
        raise TokenizerError(
            f"{target / 'tokenizer.model'} does not match {target / 'tokenizer.json'}: "
            f"{existing_diff.summary('existing')}. It was likely copied from another model. dflash-gguf's converter "
            "ignores it (it reads tokenizer.json), but SentencePiece tools would use it. Pass --repair --out DIR "
            "to put a tokenizer.model synthesized from tokenizer.json in an overlay dir."
        )
    else:
        model, vocab = synthesize_tokenizer_model(target / "tokenizer.json")
        for note in vocab.notes:
            log.info("%s", note)
        origin = "synthesized"

    # Only the "original" branch leaves model None, and then the target's own file is the one in use.
    digest = hashlib.sha256(model if model is not None else (target / "tokenizer.model").read_bytes()).hexdigest()
    overlay = None
    if out is not None:
        record = {"target": str(target.resolve()), prov.TOKENIZER_ORIGIN: origin, prov.TOKENIZER_MODEL_SHA256: digest}
        copied, linked = write_overlay(target, Path(out), model, record)
        overlay = Path(out).absolute()
        log.info("overlay %s: %d files copied, %d symlinked", overlay, copied, linked)
    elif model is not None:
        notes.append("nothing written: pass --out DIR to write the overlay")
    return FixResult(target, len(json_pieces), vocab_size, existing, existing_diff, donor_label, donor_diff, origin,
                     overlay, digest, tuple(notes))
