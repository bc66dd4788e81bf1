"""Hostile files in a repo, a folder or a manifest: a clear error naming the file, no traceback, nothing left behind,
and nothing read from outside the folder named.

A corpus generated offline from the Gemma-4 fixtures (no reference needed): each JSON file of the drafter and the
target made nested 200,000 levels deep, oversized, non-UTF-8, with NaN/Infinity or wrong types and ranges; a
safetensors index and a pair.json naming files with '..', an absolute path or a backslash. Every case goes through
``dflash-gguf precheck``, ``dflash-convert --outfile`` and the pipeline; the manifests through ``dflash-verify`` and
``tune --dry-run``; one index on the loopback Hub.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import fixtures as mf
import pytest
from conftest import run_cli

from dflash_gguf import jsonfile
from dflash_gguf.errors import UnreadableJson
from dflash_gguf.relpath import name_problem

Mutation = Callable[[Path, Path], str]  # (drafter dir, target dir) -> the file name the error must name

NESTED = b"[" * 200_000 + b"]" * 200_000


def _write(path: Path, data: bytes | str) -> str:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path.name


def _edit(path: Path, **fields: object) -> str:
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    return _write(path, json.dumps(cfg, allow_nan=True))


def _index_naming(name: str) -> Mutation:
    def mutate(drafter: Path, target: Path) -> str:
        shutil.copy(drafter / "model.safetensors", drafter.parent / "outside.safetensors")  # the file it would read
        header = mf.read_safetensors_raw(drafter / "model.safetensors")
        index = {"metadata": {}, "weight_map": {tensor: name for tensor, *_ in header}}
        (drafter / "model.safetensors").rename(drafter / "model-00001-of-00001.safetensors")
        return _write(drafter / "model.safetensors.index.json", json.dumps(index))
    return mutate


CASES: dict[str, Mutation] = {
    "drafter config nested": lambda d, t: _write(d / "config.json", NESTED),
    "drafter config not UTF-8": lambda d, t: _write(d / "config.json", b'{"hidden_size": "\xff\xfe"}'),
    "drafter config oversized": lambda d, t: _write(d / "config.json", '{"pad": "' + "x" * (2 << 20) + '"}'),
    "drafter rms_norm_eps NaN": lambda d, t: _edit(d / "config.json", rms_norm_eps=float("nan")),
    "drafter rms_norm_eps 2.0": lambda d, t: _edit(d / "config.json", rms_norm_eps=2.0),
    "drafter hidden_size a string": lambda d, t: _edit(d / "config.json", hidden_size="64"),
    "drafter num_hidden_layers -1": lambda d, t: _edit(d / "config.json", num_hidden_layers=-1),
    "drafter vocab_size Infinity": lambda d, t: _edit(d / "config.json", vocab_size=float("inf")),
    "target config nested": lambda d, t: _write(t / "config.json", NESTED),
    "target config NaN": lambda d, t: _edit(t / "config.json", rms_norm_eps=float("nan")),
    "target tokenizer.json nested": lambda d, t: _write(t / "tokenizer.json", NESTED),
    "target tokenizer.json not UTF-8": lambda d, t: _write(t / "tokenizer.json", b'{"model": "\xff"}'),
    "target tokenizer_config.json nested": lambda d, t: _write(t / "tokenizer_config.json", NESTED),
    "index names ../outside": _index_naming("../outside.safetensors"),
    "index names an absolute path": lambda d, t: _index_naming(str(d.parent / "outside.safetensors"))(d, t),
    "index names a backslash path": _index_naming("..\\outside.safetensors"),
}
# What each case's message must say besides the file's name.
WORDS = {"nested": "nested deeper", "UTF-8": "not UTF-8", "oversized": "MiB", "NaN": "NaN", "Infinity": "Infinity",
         "2.0": "between 0 and 1", "a string": "whole number", "-1": "whole number", "index": "shard"}


@pytest.fixture
def small_json_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1 MiB cap, so the oversized case needs a 2 MB file rather than a 256 MB one (the rule is the same)."""
    monkeypatch.setattr(jsonfile, "MAX_JSON_BYTES", 1 << 20)


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    target = mf.make_gemma4_target(tmp_path / "targets")
    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    return drafter, target


def _clean(proc: object, *files: str) -> str:
    out = proc.stdout + proc.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in out and proc.returncode >= 2, (proc.returncode, out[-3000:])  # type: ignore[attr-defined]
    assert any(f in out for f in files), (files, out[-3000:])
    return out


@pytest.mark.usefixtures("small_json_cap")
@pytest.mark.parametrize("case", list(CASES))
def test_every_command_refuses_with_the_file_named_and_nothing_left(tmp_path: Path, case: str) -> None:
    drafter, target = _pair(tmp_path)
    name = CASES[case](drafter, target)
    words = next(w for key, w in WORDS.items() if key in case)
    precheck = run_cli("dflash-gguf", "precheck", drafter, target)
    if name == "config.json":
        pre = _clean(precheck, name)
    else:  # precheck reads configs and cards only: what it does not read cannot fail it
        assert precheck.returncode == 0 and "Traceback" not in precheck.stderr, precheck.stdout + precheck.stderr
        pre = words
    outfile = tmp_path / "out" / "d.gguf"
    outfile.parent.mkdir()
    conv = _clean(run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outfile", outfile), name)
    pipe = _clean(run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outdir", tmp_path / "pair"),
                  name)
    for out in (pre, conv, pipe):
        assert words in out, (case, words, out[-2000:])
    assert list(outfile.parent.iterdir()) == []  # no output, no .partial
    assert not list((tmp_path / "pair").glob("**/*.gguf*")) if (tmp_path / "pair").exists() else True


@pytest.mark.parametrize("name", ["../secret/private-model.gguf", "/etc/private-model.gguf",
                                  "..\\secret\\private-model.gguf", "drafters/../../private-model.gguf"])
def test_a_manifest_naming_files_outside_its_folder_is_refused(demo_pair: Path, tmp_path: Path, name: str) -> None:
    folder = Path(shutil.copytree(demo_pair, tmp_path / "pair"))
    secret = tmp_path / "secret"
    secret.mkdir()
    shutil.copy(folder / "gemma-4-tiny-it-Q4_0.gguf", secret / "private-model.gguf")  # what it would vouch for
    doc = json.loads((folder / "pair.json").read_text())
    doc["outputs"]["target"]["file"] = name
    (folder / "pair.json").write_text(json.dumps(doc))
    for args in (("dflash-verify", folder / "pair.json"), ("dflash-gguf", "tune", folder, "--dry-run")):
        out = _clean(run_cli(*args), "pair.json")
        assert "outputs.target.file" in out and "own folder" in out, out


def test_the_pipeline_never_deletes_a_file_outside_its_folder(demo_pair: Path, tmp_path: Path) -> None:
    """A re-run removes an earlier run's outputs that pair.json records; a name outside the folder is not one."""
    folder = Path(shutil.copytree(demo_pair, tmp_path / "pair"))
    victim = tmp_path / "victim.gguf"
    shutil.copy(folder / "gemma-4-tiny-it-Q4_0.gguf", victim)
    doc = json.loads((folder / "pair.json").read_text())
    doc["outputs"]["target"]["file"] = "../victim.gguf"  # size and sha256 match: an earlier output to remove
    (folder / "pair.json").write_text(json.dumps(doc))
    target = mf.make_gemma4_target(tmp_path / "targets")
    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    run = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", folder)
    assert run.returncode == 0, run.stdout + run.stderr
    assert victim.is_file()


def test_the_loopback_hub_pipeline_refuses_an_index_that_climbs_out(tmp_path: Path) -> None:
    import hub_server
    from hub_server import FakeRepo

    drafter, target = _pair(tmp_path)
    _index_naming("../outside.safetensors")(drafter, target)
    repos = {"z-lab/gemma4-tiny-it-DFlash": FakeRepo.of_folder(drafter),
             "google/gemma-4-tiny-it": FakeRepo.of_folder(target)}
    with hub_server.serve(repos) as hub:
        run = run_cli("dflash-convert", "--target", "google/gemma-4-tiny-it", "--drafter",
                      "z-lab/gemma4-tiny-it-DFlash", "--outdir", tmp_path / "pair",
                      env=hub_server.client_env(hub.url, tmp_path / "hf"))
    out = _clean(run, "model.safetensors.index.json")
    assert "'../outside.safetensors' leaves its folder" in out
    assert not list((tmp_path / "hf").glob("**/outside.safetensors"))


def test_the_bounds_let_real_files_through_and_name_what_is_wrong(tmp_path: Path) -> None:
    assert jsonfile.parse_bounded('{"a": [1.5e-6, -2, "x"]}') == {"a": [1.5e-6, -2, "x"]}
    assert jsonfile.parse_bounded("[" * 900 + "]" * 900)  # deep, but within what a reader follows
    f = tmp_path / "c.json"
    f.write_text('{"rms_norm_eps": -Infinity}')
    with pytest.raises(UnreadableJson, match="field 'rms_norm_eps' is -Infinity") as e:
        jsonfile.load_json(f)
    assert e.value.exit_code == 2 and str(f) in str(e.value)
    for ok in ("model.safetensors", "sub/model-00001-of-00002.safetensors", "drafters/dflash-x.gguf"):
        assert name_problem(ok) is None
    for bad in ("../x", "/x", "a/../../x", "a\\b", "C:x", "", "a//b", 5):
        assert name_problem(bad) is not None, bad
