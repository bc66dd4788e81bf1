"""Tensors from a ``torch.save`` zip file, without torch and without running anything the file names.

A ``.pt`` file is a zip holding ``<name>/data.pkl`` (a pickle) and ``<name>/data/<key>`` (raw storages). A
pickle can name any Python callable, so ``pickle.load`` on a downloaded file runs code chosen by its author.
Here the unpickler resolves exactly the globals ``torch.load(weights_only=True)`` needs to rebuild tensor data
(``torch._utils._rebuild_tensor_v2``, the typed storage classes, ``collections.OrderedDict``) to stand-ins of
our own that build numpy arrays; any other global refuses the file before anything is called.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, UnsafePickleError

# torch storage class -> (numpy dtype of its raw elements, the tensor's dtype name)
_STORAGES: dict[str, tuple[np.dtype, str]] = {
    "FloatStorage": (np.dtype("<f4"), "F32"),
    "HalfStorage": (np.dtype("<f2"), "F16"),
    "BFloat16Storage": (np.dtype("<u2"), "BF16"),  # raw bits: numpy has no bfloat16
    "DoubleStorage": (np.dtype("<f8"), "F64"),
    "LongStorage": (np.dtype("<i8"), "I64"),
    "IntStorage": (np.dtype("<i4"), "I32"),
}


@dataclass(frozen=True)
class Tensor:
    """A rebuilt tensor: its elements (BF16 as uint16 bits) and its torch dtype name."""

    data: np.ndarray
    dtype: str


@dataclass(frozen=True)
class _StorageType:
    dtype: np.dtype
    name: str


def _rebuild_tensor_v2(storage: tuple[np.ndarray, str], offset: int, size: tuple[int, ...],
                       stride: tuple[int, ...], requires_grad: bool = False, hooks: Any = None,
                       metadata: Any = None) -> Tensor:
    """torch._utils._rebuild_tensor_v2 over a numpy storage: a strided view, copied."""
    data, name = storage
    view = np.lib.stride_tricks.as_strided(data[offset:], shape=tuple(size),
                                           strides=tuple(s * data.itemsize for s in stride), writeable=False)
    return Tensor(np.array(view), name)


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, archive: zipfile.ZipFile, prefix: str, path: Path, file: Any) -> None:
        super().__init__(file)
        self.archive, self.prefix, self.path = archive, prefix, path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch" and name in _STORAGES:
            return _StorageType(*_STORAGES[name])
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise UnsafePickleError(
            f"{self.path}: the pickle names {module}.{name}, which is not tensor data (only "
            "torch._utils._rebuild_tensor_v2, torch.*Storage and collections.OrderedDict are allowed). Nothing "
            "from the file was run. A genuine mask_embedding.pt holds a dict of a tensor and an int; re-download it "
            "from the drafter's repo, or delete it to convert without it.")

    def persistent_load(self, pid: Any) -> tuple[np.ndarray, str]:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise UnsafePickleError(f"{self.path}: a persistent id {pid!r:.80} that is not a tensor storage. "
                                    "Re-download the file.")
        kind, key = pid[1], str(pid[2])
        try:
            raw = self.archive.read(f"{self.prefix}/data/{key}")
        except KeyError:
            raise InputError(f"{self.path}: storage {key} is missing from the archive. Re-download it.") from None
        return np.frombuffer(raw, dtype=kind.dtype), kind.name


def load(path: Path) -> Any:
    """The object a ``torch.save`` zip holds, tensors as :class:`Tensor`.

    Raises:
        UnsafePickleError: the pickle names anything but tensor-rebuild globals (nothing is run).
        InputError: not a torch zip file, or a truncated one.
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            pkl = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                raise InputError(f"{path}: not a torch.save zip file (no <name>/data.pkl). Re-download it.")
            prefix = pkl[0].rsplit("/", 1)[0]
            byteorder = f"{prefix}/byteorder"
            if byteorder in archive.namelist() and archive.read(byteorder).strip() != b"little":
                raise InputError(f"{path}: a big-endian torch file; re-save it on a little-endian machine.")
            with archive.open(pkl[0]) as f:
                return _TensorUnpickler(archive, prefix, path, f).load()
    except (zipfile.BadZipFile, EOFError, pickle.UnpicklingError) as e:
        raise InputError(f"{path}: not a readable torch.save file ({e}). Re-download it.") from None
