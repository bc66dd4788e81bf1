"""Where a GGUF came from: one typed record, written under ``dflash_gguf.`` keys and read back by verify.

llama.cpp ignores unknown keys and llama-quantize copies them, so the record travels with the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# Prefix of this project's own provenance keys; llama.cpp ignores unknown keys and
# llama-quantize copies them (llama_model_quantize_impl copies every KV).
PROVENANCE_PREFIX = "dflash_gguf."

# Key names below the prefix, shared by the converter (writes) and verify (reads).
DRAFTER_REPO = "drafter.repo"
DRAFTER_REVISION = "drafter.revision"
DRAFTER_SOURCE = "drafter.source"
DRAFTER_BASE_MODEL = "drafter.base_model"  # its card's base_model: the model it was trained for, not converted with
TARGET_REPO = "target.repo"
TARGET_REVISION = "target.revision"
TARGET_SOURCE = "target.source"
TARGET_FILE = "target.file"  # basename of the target GGUF served beside the drafter
TARGET_ARCH = "target.architecture"
TARGET_VOCAB_SHA256 = "target.vocab_sha256"
TARGET_EMBD_FINGERPRINT = "target.embd_fingerprint"
TARGET_CONFIG_SHA256 = "target.config_sha256"
TOKENIZER_ORIGIN = "tokenizer.origin"  # "original" | "synthesized" | "donor ..."
TOKENIZER_MODEL_SHA256 = "tokenizer.model_sha256"
CONVERTER = "converter"  # "dflash-gguf <version>"
LLAMA_CPP_BUILD = "llama_cpp_build"  # the build whose output the file matches
NOTES = "notes"


def folder_label(folder: Path | str) -> str:
    """How a local source folder is recorded in a file that may be published: its name only, never the path to it
    (which carries the user's home, user name and folder layout). A Hugging Face cache snapshot
    (``models--org--name/snapshots/<commit>``) is named by its repo (``org/name``), not by the commit folder."""
    path = Path(folder)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name or str(folder)


def key(name: str) -> str:
    """The full GGUF key of a provenance field."""
    return PROVENANCE_PREFIX + name


@dataclass(frozen=True)
class Provenance:
    """What the caller knows about the inputs: Hub repos (``org/name[@rev]``), the paired target file, and the
    tokenizer overlay's own record. Built once by the caller, turned into keys by :meth:`keys`."""

    drafter_repo: str | None = None
    target_repo: str | None = None
    target_file: str | None = None
    tokenizer: dict[str, str] = field(default_factory=dict)
    # the target's embedding fingerprint, when the caller read it already (a streamed target's shards may be gone)
    target_fingerprint: str | None = None

    def keys(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for repo_key, rev_key, spec in ((DRAFTER_REPO, DRAFTER_REVISION, self.drafter_repo),
                                        (TARGET_REPO, TARGET_REVISION, self.target_repo)):
            if spec:
                repo, _, rev = spec.partition("@")
                out[repo_key] = repo
                if rev:
                    out[rev_key] = rev
        out.update(self.tokenizer)
        if self.target_file:
            out[TARGET_FILE] = Path(self.target_file).name
        if self.target_fingerprint:
            out[TARGET_EMBD_FINGERPRINT] = self.target_fingerprint
        return out
