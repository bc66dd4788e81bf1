"""dflash-verify: one fixture pair per check that fails it, one pair that passes all, and a header fuzz test.

Drafter GGUFs come from our converter on tests/fixtures drafters; target GGUFs are tiny synthetic
files written with GGUFPlan (the tokenizer copied from the drafter, token_embd from the fixture weights).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fixtures as mf
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import REFERENCE_COMPARISONS
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf import quants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_gguf import fingerprint as efp
from dflash_gguf.cli.verify import verify_cmd
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.errors import InputError
from dflash_gguf.ggufio.reader import GGUFMeta, tensor_nbytes
from dflash_gguf.ggufio.writer import GGUFPlan, TensorOut
from dflash_gguf.verify import precheck, read_gguf, verify_files
from dflash_gguf.verify.lineage import known_target_for, parse_name

REPO = Path(__file__).resolve().parents[1]

EMBED = "model.language_model.embed_tokens.weight"


# ------------------------------------------------------------------------------------------- helpers


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def rewrite(src: Path, dst: Path, *, kv: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
            rename: dict[str, str] | None = None, arch: str | None = None,
            extra: dict[str, tuple[tuple[int, ...], bytes]] | None = None) -> Path:
    """Copy a GGUF with edited metadata (key -> (vtype, value[, subtype])) and renamed/added F32 tensors."""
    meta = read_gguf(src)
    plan = GGUFPlan(arch or meta.arch or "dflash")
    for key, v in meta.kv.items():
        if key != "general.architecture" and key not in drop:
            plan.add(key, VT(v.vtype), _plain(v.value), VT(v.subtype) if v.subtype is not None else None)
    for key, spec in (kv or {}).items():
        plan.add(key, *spec)
    raw = src.read_bytes()
    for t in meta.tensors.values():
        start = meta.data_offset + t.offset
        data = raw[start:start + tensor_nbytes(t, src)]
        plan.add_tensor(TensorOut((rename or {}).get(t.name, t.name), t.ne, QT(t.qtype),
                                  lambda f, data=data: f.write(data)))
    for name, (ne, data) in (extra or {}).items():
        plan.add_tensor(TensorOut(name, ne, QT.F32, lambda f, data=data: f.write(data)))
    plan.write(dst)
    return dst


def target_gguf(path: Path, drafter: GGUFMeta, *, arch: str = "gemma4", n_layer: int = 6, hidden: int = 64,
                name: str = "gemma-4-tiny-it", base_model: str | None = "https://huggingface.co/google/gemma-4-12B",
                embd: np.ndarray | None = None, qtype: QT = QT.Q8_0,
                edit_vocab: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """A metadata-true target GGUF: tokenizer copied from ``drafter``, token_embd from ``embd``."""
    plan = GGUFPlan(arch)
    plan.add_string("general.name", name)
    if base_model:
        plan.add_uint32("general.base_model.count", 1)
        plan.add_string("general.base_model.0.repo_url", base_model)
    plan.add_uint32(f"{arch}.block_count", n_layer)
    plan.add_uint32(f"{arch}.embedding_length", hidden)
    plan.add_uint32(f"{arch}.context_length", 4096)
    vocab = {k: (v.vtype, _plain(v.value), v.subtype) for k, v in drafter.kv.items() if k.startswith("tokenizer.")}
    if edit_vocab:
        edit_vocab(vocab)
    for key, (vtype, value, sub) in vocab.items():
        plan.add(key, VT(vtype), value, VT(sub) if sub is not None else None)
    n_vocab = len(vocab["tokenizer.ggml.tokens"][1])
    if embd is None:
        embd = np.random.default_rng(7).standard_normal((n_vocab, hidden)).astype(np.float32) * 0.02
    data = quants.quantize(embd.astype(np.float32), qtype).tobytes()
    plan.add_tensor(TensorOut("token_embd.weight", (hidden, embd.shape[0]), qtype, lambda f: f.write(data)))
    norm = np.ones(hidden, dtype=np.float32).tobytes()
    plan.add_tensor(TensorOut("output_norm.weight", (hidden,), QT.F32, lambda f: f.write(norm)))
    plan.write(path)
    return path


def ids(report: Any, status: str = "fail") -> dict[str, str]:
    return {r.id: r.severity for r in report.results if r.status == status}


@pytest.fixture(scope="session")
def fx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Fixture dirs, the converted drafter (with a recorded embedding fingerprint) and the target weights."""
    root = tmp_path_factory.mktemp("verify")
    vanilla = mf.make_gemma4_target(root / "targets")
    qat = mf.make_gemma4_target(root / "targets", qat=True)
    drafter_dir = mf.make_drafter(root / "drafters", target="gemma4")
    embd = mf._gemma4_tensors(qat=False)[EMBED]
    n_vocab = embd.shape[0]
    fp = efp.encode(efp.compute(embd[efp.sample_rows(n_vocab)], n_vocab))
    drafter = root / "gemma4-tiny-it-DFlash-BF16.gguf"
    convert_drafter(drafter_dir, vanilla, drafter, provenance={"target.embd_fingerprint": fp})
    meta = read_gguf(drafter)
    good_target = target_gguf(root / "gemma-4-tiny-it-Q8_0.gguf", meta, embd=embd)
    return {"root": root, "vanilla": vanilla, "qat": qat, "drafter_dir": drafter_dir, "drafter": drafter,
            "meta": meta, "embd": embd, "qat_embd": mf._gemma4_tensors(qat=True)[EMBED], "target": good_target}


# ------------------------------------------------------------------------------------------- passing pair


def test_good_pair_passes_every_check(fx: dict[str, Any]) -> None:
    report = verify_files(fx["drafter"], fx["target"])
    assert report.exit_code == 0, [r for r in report.results if r.status == "fail"]
    assert ids(report) == {}
    assert report.result("lineage.fingerprint").status == "pass"
    assert "--spec-draft-n-max can go up to 15" in report.result("pair.block_size").message


def test_cli_table_and_json(fx: dict[str, Any]) -> None:
    runner = CliRunner()
    res = runner.invoke(verify_cmd, [str(fx["drafter"]), str(fx["target"])])
    assert res.exit_code == 0, res.output
    assert "pair.taps" in res.output and "can be served" in res.output
    res = runner.invoke(verify_cmd, [str(fx["drafter"]), str(fx["target"]), "--json"])
    doc = json.loads(res.output)
    assert doc["servable"] is True and doc["errors"] == 0
    assert {c["id"] for c in doc["checks"]} >= {"format.arch", "pair.vocab", "lineage.fingerprint"}


def test_drafter_alone_uses_its_provenance(fx: dict[str, Any]) -> None:
    report = verify_files(fx["drafter"])
    assert report.exit_code == 0
    assert report.result("lineage.vocab_record").status == "pass"
    assert report.result("pair.target").status == "skip"


# ------------------------------------------------------------------------------------------- lineage


def test_qat_target_caught_by_gguf_check(fx: dict[str, Any]) -> None:
    qat = target_gguf(fx["root"] / "qat.gguf", fx["meta"], name="gemma-4-tiny-it-qat-q4_0-unquantized",
                      base_model="https://huggingface.co/google/gemma-4-12B-it", embd=fx["qat_embd"])
    report = verify_files(fx["drafter"], qat)
    assert ids(report) == {"lineage.derived_target": "error"}
    assert "QAT" in report.result("lineage.derived_target").message
    res = CliRunner().invoke(verify_cmd, [str(fx["drafter"]), str(qat)])
    assert res.exit_code == 1 and "MUST NOT be served" in res.output
    allowed = verify_files(fx["drafter"], qat, allow_derived_target=True)
    assert allowed.exit_code == 0 and ids(allowed) == {"lineage.derived_target": "warning"}


def test_qat_target_caught_by_precheck(fx: dict[str, Any]) -> None:
    kw = {"drafter_repo": "z-lab/gemma4-12B-it-DFlash"}
    card = (fx["qat"] / "README.md").read_text()
    bad = precheck(fx["drafter_dir"] / "config.json", fx["qat"] / "config.json",
                   target_repo="google/gemma-4-12B-it-qat-q4_0-unquantized", target_card=card, **kw)
    assert ids(bad) == {"lineage.derived_target": "error"}
    good = precheck(fx["drafter_dir"] / "config.json", fx["vanilla"] / "config.json",
                    target_repo="google/gemma-4-12B-it", target_card=(fx["vanilla"] / "README.md").read_text(), **kw)
    assert good.exit_code == 0 and ids(good) == {}


def test_precheck_hidden_size_and_taps(fx: dict[str, Any]) -> None:
    d = json.loads((fx["drafter_dir"] / "config.json").read_text())
    t = json.loads((fx["vanilla"] / "config.json").read_text())
    report = precheck({**d, "hidden_size": 96, "dflash_config": {**d["dflash_config"], "target_layer_ids": [1, 5]}}, t)
    assert {"pair.hidden_size", "pair.taps"} <= set(ids(report))


def test_other_size_of_same_family(fx: dict[str, Any]) -> None:
    drafter = rewrite(fx["drafter"], fx["root"] / "d-12b.gguf",
                      kv={"dflash_gguf.target.repo": (VT.STRING, "google/gemma-4-12B-it")})
    target = target_gguf(fx["root"] / "gemma-4-27B-it.gguf", fx["meta"], name="gemma-4-27B-it",
                         base_model="https://huggingface.co/google/gemma-4-27B", embd=fx["embd"])
    assert ids(verify_files(drafter, target)) == {"lineage.size": "error"}


def test_fingerprint_of_another_model(fx: dict[str, Any]) -> None:
    other = target_gguf(fx["root"] / "other.gguf", fx["meta"])  # random embedding, same names
    report = verify_files(fx["drafter"], other)
    assert ids(report) == {"lineage.fingerprint": "error"}
    assert "mean row cosine" in report.result("lineage.fingerprint").message


def test_fingerprint_survives_quantization(fx: dict[str, Any]) -> None:
    q4 = target_gguf(fx["root"] / "q4.gguf", fx["meta"], embd=fx["embd"], qtype=QT.Q4_0)
    assert verify_files(fx["drafter"], q4).result("lineage.fingerprint").status == "pass"


def test_name_parsing_and_known_pairs() -> None:
    n = parse_name("https://huggingface.co/google/gemma-4-12B-it-qat-q4_0-unquantized")
    assert (n.family, n.size, n.markers) == ("gemma4", "12b", ("qat", "unquantized"))
    assert parse_name("Qwen/Qwen3-Coder-30B-A3B-Instruct").size == "30b-a3b"
    pair = known_target_for("z-lab/gemma4-12B-it-DFlash")
    assert pair is not None and pair.target == "google/gemma-4-12B-it"


# ------------------------------------------------------------------------------------------- pair


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"n_layer": 3}, {"pair.taps"}),  # taps [2, 4] beyond a 3-layer target
        ({"n_layer": 4}, {"pair.taps"}),  # tap 4 == n_layer: 'layer input tensor is null'
        ({"hidden": 96}, {"pair.hidden_size", "pair.fc_width", "lineage.fingerprint", "pair.embedding_scale"}),
        ({"arch": "gemma3"}, {"pair.target_arch"}),
    ],
)
def test_structural_mismatch(fx: dict[str, Any], kwargs: dict[str, Any], expected: set[str]) -> None:
    embd = fx["embd"] if kwargs.get("hidden", 64) == 64 else None
    target = target_gguf(fx["root"] / f"t-{'-'.join(map(str, kwargs.values()))}.gguf", fx["meta"], embd=embd,
                         **kwargs)
    report = verify_files(fx["drafter"], target)
    assert set(ids(report)) == expected
    assert report.exit_code == 1


def _rename_token(vocab: dict[str, Any]) -> None:
    vtype, tokens, sub = vocab["tokenizer.ggml.tokens"]
    tokens = list(tokens)
    tokens[1] = "<end_of_turn>"  # the eos token's string differs, nothing else
    vocab["tokenizer.ggml.tokens"] = (vtype, tokens, sub)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (_rename_token, {"pair.vocab", "lineage.vocab_record"}),
        (lambda v: v.update({"tokenizer.ggml.bos_token_id": (VT.UINT32, 5, None)}), {"pair.special_tokens"}),
    ],
)
def test_vocab_differs_in_one_special_token(fx: dict[str, Any], edit: Callable, expected: set[str]) -> None:
    target = target_gguf(fx["root"] / f"vocab-{len(expected)}.gguf", fx["meta"], embd=fx["embd"], edit_vocab=edit)
    report = verify_files(fx["drafter"], target)
    assert set(ids(report)) == expected
    if "pair.vocab" in expected:
        assert "first difference at id 1" in report.result("pair.vocab").message


def test_mask_outside_target_vocab(fx: dict[str, Any]) -> None:
    d = rewrite(fx["drafter"], fx["root"] / "mask.gguf", kv={"tokenizer.ggml.mask_token_id": (VT.UINT32, 9999)})
    assert set(ids(verify_files(d, fx["target"]))) == {"pair.mask_token"}


def test_gemma_target_without_embedding_scale(fx: dict[str, Any]) -> None:
    d = rewrite(fx["drafter"], fx["root"] / "noscale.gguf", drop=("dflash.embedding_scale",))
    assert ids(verify_files(d, fx["target"])) == {"pair.embedding_scale": "error"}


# ------------------------------------------------------------------------------------------- format


FORMAT_VARIANTS: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], set[str]]] = {
    "fork": (lambda fx: {"arch": "dflash-draft"}, {"format.arch"}),
    "pre_merge": (lambda fx: {"rename": {"enc.output_norm.weight": "hidden_norm.weight"},
                              "drop": ("tokenizer.ggml.mask_token_id",),
                              "kv": {"dflash.mask_token_id": (VT.UINT32, 4),
                                     "dflash.target_layers": (VT.ARRAY, [1, 3], VT.INT32)}},
                  {"format.layout", "format.mask_token", "format.tensors"}),
    "no_taps": (lambda fx: {"drop": ("dflash.target_layers",)}, {"format.keys"}),
    "int32_scalar": (lambda fx: {"kv": {"dflash.block_size": (VT.INT32, 16)}}, {"format.key_types"}),
    "int64_taps": (lambda fx: {"kv": {"dflash.target_layers": (VT.ARRAY, [2, 4], VT.INT64)}}, {"format.key_types"}),
    "swa_no_pattern": (lambda fx: {"drop": ("dflash.attention.sliding_window_pattern",)}, {"format.sliding_window"}),
    "bias": (lambda fx: {"extra": {"blk.0.attn_q.bias": ((64,), bytes(256))}}, {"format.bias"}),
    "unknown_tensor": (lambda fx: {"extra": {"blk.0.attn_gate.weight": ((64,), bytes(256))}}, {"format.tensors"}),
    "missing_tensor": (lambda fx: {"rename": {"blk.1.ffn_down.weight": "blk.1.ffn_down2.weight"}},
                       {"format.tensors"}),
    "shapes": (lambda fx: {"kv": {"dflash.embedding_length": (VT.UINT32, 32)}}, {"format.shapes", "pair.hidden_size"}),
}


def format_variant(fx: dict[str, Any], name: str) -> Path:
    path = fx["root"] / f"fmt-{name}.gguf"
    if not path.exists():
        rewrite(fx["drafter"], path, **FORMAT_VARIANTS[name][0](fx))
    return path


@pytest.mark.parametrize("name", list(FORMAT_VARIANTS))
def test_format_violation(fx: dict[str, Any], name: str) -> None:
    d = format_variant(fx, name)
    report = verify_files(d, fx["target"])
    failed = {k for k, v in ids(report).items() if v == "error"}
    assert failed == FORMAT_VARIANTS[name][1]
    assert CliRunner().invoke(verify_cmd, [str(d), str(fx["target"])]).exit_code == 1


def test_swapped_arguments(fx: dict[str, Any]) -> None:
    report = verify_files(fx["target"], fx["drafter"])
    assert set(ids(report)) == {"format.arch"}
    assert "drafter GGUF first" in report.result("format.arch").fix


# ------------------------------------------------------------------------------------------- unreadable input


def _header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "empty"),
        (b"PK\x03\x04" + bytes(60), "not a GGUF"),
        (b"GGUF" + struct.pack("<I", 99) + bytes(16), "version 99"),
        (_header(1 << 40, 0), "tensor count"),
        (_header(0, 1 << 40), "metadata count"),
        (_header(0, 1) + struct.pack("<Q", 1 << 62), "claims"),
        (_header(0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 5, 1 << 60), "claims"),
        (_header(0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 5, 1 << 20), "remain"),
        (_header(0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<II", 9, 9) + bytes(8), "nested"),
        (_header(1, 0) + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 77) + bytes(32), "dimensions"),
    ],
)
def test_hostile_headers_exit_2(tmp_path: Path, data: bytes, needle: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(InputError, match=needle):
        read_gguf(path)
    res = CliRunner().invoke(verify_cmd, [str(path)])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_truncated_drafter_exit_2(fx: dict[str, Any], tmp_path: Path) -> None:
    raw = fx["drafter"].read_bytes()
    for cut in (10, len(raw) // 3, len(raw) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(raw[:cut])
        res = CliRunner().invoke(verify_cmd, [str(path), str(fx["target"])])
        assert res.exit_code == 2, (cut, res.output)


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    plan = GGUFPlan("dflash")
    plan.add_uint32("dflash.block_count", 1)
    plan.add_array("dflash.target_layers", [2, 4])
    plan.add_array("tokenizer.ggml.tokens", ["a", "bb", "<mask>"])
    data = np.ones(32, dtype=np.float32).tobytes()
    plan.add_tensor(TensorOut("fc.weight", (32,), QT.F32, lambda f: f.write(data)))
    path = tmp_path_factory.mktemp("fuzz") / "small.gguf"
    plan.write(path)
    return path.read_bytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.integers(0, 600), widen=st.sampled_from([None, 0xFF, 0x7F]))
def test_fuzz_mutated_headers(small_gguf: bytes, tmp_path_factory: pytest.TempPathFactory,
                              edits: list[tuple[int, int]], cut: int, widen: int | None) -> None:
    """Any byte edits/truncation: a GGUFMeta or an InputError, never another exception."""
    buf = bytearray(small_gguf)
    for pos, val in edits:
        if pos < len(buf):
            buf[pos] = val
            if widen is not None and pos + 7 < len(buf):
                buf[pos + 7] = widen  # make a u64 length or count huge
    path = tmp_path_factory.getbasetemp() / "fuzz.gguf"
    path.write_bytes(bytes(buf[:cut] if cut < len(buf) else buf))
    try:
        meta = read_gguf(path)
    except InputError:
        return
    verify_files(path)  # checks on whatever parsed must not raise either
    assert isinstance(meta, GGUFMeta)


# ------------------------------------------------------------------------------------------- llama.cpp agrees

import reference as ref  # noqa: E402


@pytest.mark.reference
@pytest.mark.parametrize("name", ["fork", "pre_merge", "no_taps", "int32_scalar", "bias", "unknown_tensor",
                                  "missing_tensor"])
def test_libllama_refuses_what_verify_refuses(fx: dict[str, Any], name: str) -> None:
    """Every drafter file verify calls unloadable is refused by b11434's own loader (and the good one loads)."""
    ref.require_or_skip(ref.llama_cpp_available())
    path = format_variant(fx, name)
    assert verify_files(path).exit_code == 1
    loaded, log = ref.load_with_libllama(path)
    assert not loaded, log[-2000:]
    assert ref.load_with_libllama(fx["drafter"])[0]
    REFERENCE_COMPARISONS.append(f"libllama-refuses/{name}")


@pytest.mark.parametrize(
    ("taps", "target_embd", "expected"),
    [((1,), 64, None), ((2,), 64, "pair.taps"), ((3,), 64, "pair.taps"), ((1,), 128, "pair.hidden_size")],
)
@pytest.mark.reference
def test_llama_server_fails_where_verify_predicts(tmp_path: Path, taps: tuple[int, ...], target_embd: int,
                                                  expected: str | None) -> None:
    """b11434 llama-server with --spec-type draft-dflash aborts exactly on the pairs verify refuses."""
    ref.require_or_skip(ref.llama_cpp_available())
    target = ref.write_tiny_llama_gguf(tmp_path / "target.gguf", n_layer=2, n_embd=target_embd)
    drafter = ref.write_tiny_dflash_gguf(tmp_path / "drafter.gguf", target_layers=taps)
    report = verify_files(drafter, target)
    errors = {r.id for r in report.errors}
    assert expected in errors if expected else not errors
    with ref.start_llama_server(target, drafter) as server:
        served = server.ready
        if served:
            try:
                status, _ = ref.http_json(f"{server.url}/completion", {"prompt": "Hello", "n_predict": 8})
                served = status == 200
            except OSError:
                served = False
            served = served and server.alive
    assert served == (expected is None), server.output[-2000:]
    REFERENCE_COMPARISONS.append(f"llama-server/verify-predicts/{taps}/{target_embd}")


def test_drafter_converted_against_qat_target_is_refused_alone(tmp_path: Path) -> None:
    """Lineage with no target file: the published pair vs the target recorded at conversion."""
    import fixtures as mf

    from dflash_gguf.drafters import convert_drafter

    drafter = mf.make_drafter(tmp_path / "d", target="gemma4")
    qat = mf.make_gemma4_target(tmp_path / "t", qat=True)
    vanilla = mf.make_gemma4_target(tmp_path / "v")
    runner = CliRunner()
    for target, repo, code in ((qat, "google/gemma-4-12B-it-qat-q4_0-unquantized", 1),
                               (vanilla, "google/gemma-4-12B-it", 0)):
        out = tmp_path / f"{target.name}.gguf"
        convert_drafter(drafter, target, out, provenance={"drafter.repo": "z-lab/gemma4-12B-it-DFlash",
                                                          "target.repo": repo})
        result = runner.invoke(verify_cmd, [str(out), "--json"])
        assert result.exit_code == code, result.output
        checks = {c["id"]: c["status"] for c in json.loads(result.output)["checks"]}
        assert checks["lineage.derived_target"] == ("fail" if code else "pass")


def test_either_file_of_the_sidecar_layout_finds_the_pair(demo_pair: Path, tmp_path: Path) -> None:
    """A target given alone is judged with the dflash-* sidecar beside it; a sidecar whose recorded target file
    is gone (renamed by hand, or a file nobody here wrote) is judged with the folder's one target."""
    import shutil

    from dflash_gguf.verify import verify_files

    by_target = verify_files(demo_pair / "gemma-4-tiny-it-Q4_0.gguf")
    assert by_target.result("pair.found").message.startswith("drafter dflash-gemma-4-tiny-it-Q8_0.gguf found")
    assert by_target.exit_code == 0 and by_target.result("pair.vocab").status == "pass"
    folder = tmp_path / "renamed"
    folder.mkdir()
    shutil.copy(demo_pair / "dflash-gemma-4-tiny-it-Q8_0.gguf", folder)
    shutil.copy(demo_pair / "gemma-4-tiny-it-Q4_0.gguf", folder / "target.gguf")
    by_sidecar = verify_files(folder / "dflash-gemma-4-tiny-it-Q8_0.gguf")
    assert "target target.gguf found beside the sidecar" in by_sidecar.result("pair.found").message
    assert by_sidecar.exit_code == 0 and by_sidecar.result("pair.hidden_size").status == "pass"
    (folder / "second.gguf").write_bytes((folder / "target.gguf").read_bytes())  # two targets: ambiguous
    alone = verify_files(folder / "dflash-gemma-4-tiny-it-Q8_0.gguf")
    assert alone.result("pair.found") is None and alone.result("pair.target").status == "skip"
