"""The parity comparator's own GGUF reader gives exactly what gguf-py's GGUFReader gives, and diff sees one byte.

Every parity test's verdict rests on ``gguf_compare``; its reader is the tests' own (gguf-py's takes seconds per
large vocabulary), so it is checked here against gguf-py on files gguf-py and b11434's llama-quantize wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import reference
from gguf import GGUFReader, GGUFValueType
from gguf_compare import diff, read_kv, read_tensors, read_version


def _gguf_py_view(path: Path) -> tuple[int, dict[str, tuple[list[str], Any]], dict[str, tuple[str, list[int], bytes]]]:
    """Version, keys and tensors as gguf-py's GGUFReader reads them."""
    r = GGUFReader(path)
    kv: dict[str, tuple[list[str], Any]] = {}
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        types = [GGUFValueType(t).name for t in f.types]
        value = [f.contents(i) for i in range(len(f.data))] if f.types[0] == GGUFValueType.ARRAY else f.contents()
        kv[f.name] = (types, value)
    tensors = {t.name: (t.tensor_type.name, [int(x) for x in t.shape], np.asarray(t.data).tobytes())
               for t in r.tensors}
    return int(r.fields["GGUF.version"].contents()), kv, tensors


def _every_value_type(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁world")
    w.add_array("t.strs", ["a", "", "▁b", "日本"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((2, 5)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_same_as_gguf_py(path: Path) -> None:
    version, kv, tensors = _gguf_py_view(path)
    assert read_version(path) == version
    assert list(read_kv(path).items()) == list(kv.items())  # same keys, order, types and values
    assert list(read_tensors(path).items()) == list(tensors.items())


def test_every_value_type_reads_as_gguf_py_reads_it(tmp_path: Path) -> None:
    _assert_same_as_gguf_py(_every_value_type(tmp_path / "types.gguf"))


def test_llama_quantize_outputs_read_as_gguf_py_reads_them(tmp_path: Path) -> None:
    """A 32k-token SPM vocabulary and Q4_0/Q6_K/Q8_0 tensors, as b11434's llama-quantize wrote them."""
    reference.require_or_skip(reference.llama_cpp_available())
    src = reference.write_tiny_llama_gguf(tmp_path / "tiny-F16.gguf", n_embd=256)
    _assert_same_as_gguf_py(src)
    for qtype in ("Q4_0", "Q8_0", "Q6_K"):
        out = tmp_path / f"tiny-{qtype}.gguf"
        proc = reference.run_llama_quantize(src, out, qtype)
        assert proc.returncode == 0, proc.stderr[-2000:]
        _assert_same_as_gguf_py(out)


def _rewrite(src: Path, dst: Path, edit: Any) -> Path:
    """A copy of ``src`` with ``edit(data)`` applied to its bytes."""
    data = bytearray(src.read_bytes())
    edit(data)
    dst.write_bytes(bytes(data))
    return dst


def test_diff_sees_one_changed_byte_in_a_string_array_and_in_tensor_data(tmp_path: Path) -> None:
    src = _every_value_type(tmp_path / "a.gguf")
    assert diff(src, src) == []
    at = src.read_bytes().index("日本".encode())
    one_string = _rewrite(src, tmp_path / "b.gguf", lambda d: d.__setitem__(at + 5, d[at + 5] ^ 1))
    assert diff(src, one_string) == [f"key t.strs: ours {read_kv(src)['t.strs']!r} vs ref "
                                     f"{read_kv(one_string)['t.strs']!r}"]
    weight = read_tensors(src)["b.weight"][2]
    end = src.read_bytes().rindex(weight) + len(weight) - 1  # its last byte (the padding after it is no data)
    last = _rewrite(src, tmp_path / "c.gguf", lambda d: d.__setitem__(end, d[end] ^ 1))
    assert diff(src, last) == ["tensor b.weight: bytes differ"]


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    src = _every_value_type(tmp_path / "a.gguf")
    at = src.read_bytes().index(b"t.i16")
    same_name = _rewrite(src, tmp_path / "dup.gguf", lambda d: d.__setitem__(slice(at, at + 5), b"t.u16"))
    with pytest.raises(ValueError, match="duplicate key t.u16"):
        read_kv(same_name)
    with pytest.raises(KeyError, match="Duplicate"):  # gguf-py refuses it too
        GGUFReader(same_name)
