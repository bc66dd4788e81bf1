"""Several quant tags in one run (``--quant Q4_K_M,Q6_K,Q8_0``), laid out as a Hub repo of several tags is.

- Each tag's target and drafter are the bytes a run of that tag alone writes, and the checkpoint's weights are read
  once for all the tags (the bytes read equal a one-tag run's); pair.json, models.ini and verify name every tag; a
  re-run reuses them, and a later run of one tag removes the others.
- Published, b11434's ``llama-server -hf REPO:Q8_0``, ``-hf REPO:Q6_K`` and ``-hf REPO`` each download the target of
  that tag and the drafter named with the same tag (``find_best_model``, ``find_best_sibling``) and draft with it;
  ``llama-server --models-preset models.ini`` in the folder serves each tag with its own files.
"""

from __future__ import annotations

import json
from pathlib import Path

import fixtures as mf
import hub_server
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli, run_tune
from test_one_pass import _bytes_read_from

from dflash_gguf.fingerprint import N_ROWS

TOKEN = "hf_tagsTestToken0123456789abcdef"
REPO = "me/qwen3-tiny-spm-DFlash-GGUF"
TAGS = ("Q4_K_M", "Q6_K", "Q8_0")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.glob("*.gguf")}


def test_three_tags_in_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = mf.make_gemma4_target(tmp_path / "targets")
    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    counted = _bytes_read_from(monkeypatch, target)
    alone: dict[str, bytes] = {}
    read_alone = 0
    for tag in TAGS:
        counted["bytes"] = 0
        proc = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--quant", tag, "--draft-quant",
                       tag, "--outdir", tmp_path / f"alone-{tag}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        read_alone = counted["bytes"]
        alone |= _files(tmp_path / f"alone-{tag}")
    folder = tmp_path / "tags"
    counted["bytes"] = 0
    proc = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--quant", ",".join(TAGS),
                   "--outdir", folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the target's weights once for the three tags; each of the three drafters (one per tag) reads the rows of the
    # target's token embedding its fingerprint samples (fingerprint.N_ROWS BF16 rows), one run of one tag one of them
    hidden = json.loads((target / "config.json").read_text())["text_config"]["hidden_size"]
    fingerprint = N_ROWS * hidden * 2
    weights = sum(p.stat().st_size for p in target.glob("*.safetensors"))
    assert read_alone <= weights + fingerprint and counted["bytes"] == read_alone + 2 * fingerprint, \
        (counted, read_alone, weights)

    made = _files(folder)
    names = [f"gemma-4-tiny-it-{t}.gguf" for t in TAGS] + [f"dflash-gemma-4-tiny-it-{t}.gguf" for t in TAGS]
    assert sorted(made) == sorted(names)
    for name in names:
        assert made[name] == alone[name], name

    doc = json.loads((folder / "pair.json").read_text())
    assert [t["tag"] for t in doc["outputs"]["tags"]] == [t.lower() for t in TAGS]
    assert [(t["target"]["file"], t["drafter"]["file"], t["verify"]["servable"]) for t in doc["outputs"]["tags"]] == [
        (f"gemma-4-tiny-it-{t}.gguf", f"dflash-gemma-4-tiny-it-{t}.gguf", True) for t in TAGS]
    assert doc["outputs"]["target"]["file"] == "gemma-4-tiny-it-Q4_K_M.gguf"
    assert doc["options"]["tags"] == [t.lower() for t in TAGS] and doc["serve"]["hub"].startswith(
        "llama-server -hf USER/REPO:Q4_K_M ")
    preset = (folder / "models.ini").read_text()
    for t in TAGS:
        assert (f"[gemma-4-tiny-it-{t}]\nmodel = gemma-4-tiny-it-{t}.gguf\n"
                f"model-draft = dflash-gemma-4-tiny-it-{t}.gguf\n") in preset, preset
    verify = run_cli("dflash-verify", folder / "pair.json", "--json")
    assert verify.returncode == 0, verify.stdout
    checks = {c["id"]: c["status"] for c in json.loads(verify.stdout)["checks"]}
    assert checks["pair.tags.q6_k"] == checks["pair.tags.q8_0"] == "pass", checks
    assert checks["manifest.tags.q8_0.gemma-4-tiny-it-Q8_0.gguf"] == "pass"

    # a changed tag is caught; a re-run reuses every file; a later run of one tag leaves only it
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.gguf")}
    again = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--quant", ",".join(TAGS),
                    "--outdir", folder)
    assert again.returncode == 0 and {p.name: p.stat().st_mtime_ns for p in folder.glob("*.gguf")} == stamps
    (folder / "dflash-gemma-4-tiny-it-Q6_K.gguf").write_bytes(alone["dflash-gemma-4-tiny-it-Q8_0.gguf"])
    changed = run_cli("dflash-verify", folder / "pair.json", "--json")
    checks = {c["id"]: c["status"] for c in json.loads(changed.stdout)["checks"]}
    assert changed.returncode != 0 and checks["manifest.tags.q6_k.dflash-gemma-4-tiny-it-Q6_K.gguf"] == "fail"
    (folder / "dflash-gemma-4-tiny-it-Q6_K.gguf").write_bytes(alone["dflash-gemma-4-tiny-it-Q6_K.gguf"])
    one = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--quant", "q8_0", "--outdir", folder)
    assert one.returncode == 0, one.stdout + one.stderr
    assert sorted(_files(folder)) == ["dflash-gemma-4-tiny-it-Q8_0.gguf", "gemma-4-tiny-it-Q8_0.gguf"]
    assert "tags" not in json.loads((folder / "pair.json").read_text())["outputs"]


@pytest.mark.parametrize(("args", "message"), [
    (["--quant", "q8_0,Q8_0"], "names a tag twice"),
    (["--quant", "q4_0,q8_0", "--draft-quant", "q8_0,q8_0,q4_0"], "names 3 types for 2 --quant tag(s)"),
    (["--quant", "q4_0,q8_0", "--target-gguf", "x.gguf"], "--target-gguf is used as it is"),
])
def test_several_tags_refused_with_the_way_out(tmp_path: Path, args: list[str], message: str) -> None:
    target = mf.make_gemma4_target(tmp_path / "targets")
    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    proc = run_cli("dflash-convert", "--target", target, "--drafter", drafter, *args, "--outdir", tmp_path / "out")
    assert proc.returncode not in (0, 1) and message in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.reference
def test_a_three_tag_repo_is_served_tag_by_tag(tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    from test_serve_layout import PROMPT, _server_env

    from dflash_gguf.llama_bin import FoundBinary
    from dflash_gguf.tune.server import serve as run_llama_server

    fx = mf.make_acceptance_fixture(tmp_path / "fx")
    folder = tmp_path / "out" / "qwen3-tiny-spm"
    made = run_cli("dflash-convert", "--target", fx.target, "--drafter", fx.drafter, "--quant", ",".join(TAGS),
                   "--keep-intermediate", "--outdir", folder)  # the BF16 conversion kept: quality's base
    assert made.returncode == 0, made.stdout + made.stderr
    binary = FoundBinary(reference.llama_bin("llama-server"), "test")
    served: dict[str, tuple[list[str], dict[str, float]]] = {}
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        env = hub_server.client_env(hub.url, tmp_path / "hf") | {"HF_TOKEN": TOKEN}
        proc = run_cli("dflash-gguf", "publish", folder, REPO, "--license", "mit", env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        published = set(hub.repos[REPO].files)
        card = hub.repos[REPO].files["README.md"].decode()
        for tag in (":Q8_0", ":Q6_K", ""):
            hub.requests.clear()
            args = ["-hf", REPO + tag, "--spec-type", "draft-dflash", "-t", "1", "-c", "1024"]
            with run_llama_server(binary, args, startup_timeout=180,
                                  env=_server_env(hub, tmp_path / f"serve{tag.strip(':')}"),
                                  workdir=tmp_path) as server:
                status, body = server.request("/completion", PROMPT, timeout=120)
            assert status == 200 and isinstance(body, dict), (status, body, server.log()[-3000:])
            served[tag] = (sorted(set(hub.downloads())), body["timings"])
    assert published >= {f"qwen3-tiny-spm-{t}.gguf" for t in TAGS} | {f"dflash-qwen3-tiny-spm-{t}.gguf" for t in TAGS}
    for tag, want in ((":Q8_0", "Q8_0"), (":Q6_K", "Q6_K"), ("", "Q4_K_M")):  # no tag: Q4_K_M, find_best_model
        downloads, timings = served[tag]
        assert downloads == [f"dflash-qwen3-tiny-spm-{want}.gguf", f"qwen3-tiny-spm-{want}.gguf"], (tag, downloads)
        assert timings["draft_n"] > 0 and timings["draft_n_accepted"] > 0, (tag, timings)
        assert f"llama-server -hf {REPO}:{want} --spec-type draft-dflash" in card, card
    REFERENCE_COMPARISONS.append("llama-server -hf REPO:Q8_0 / REPO:Q6_K / REPO three-tag repo")

    # the folder itself, served by the router from its preset: each tag with its own target and drafter
    with run_llama_server(binary, ["--models-preset", "models.ini", "-t", "1", "-c", "1024"], startup_timeout=180,
                          workdir=tmp_path, env=_server_env(hub, tmp_path / "router"), cwd=folder) as router:
        answer = router.post("/completion", {**PROMPT, "model": "qwen3-tiny-spm-Q6_K"}, timeout=300)
        _, listing = router.request("/models", timeout=30)
    models = {m["id"]: m for m in listing["data"]}
    assert {f"qwen3-tiny-spm-{t}" for t in TAGS} <= set(models), sorted(models)
    args = models["qwen3-tiny-spm-Q6_K"]["status"]["args"]
    assert "qwen3-tiny-spm-Q6_K.gguf" in " ".join(args) and "dflash-qwen3-tiny-spm-Q6_K.gguf" in " ".join(args), args
    assert answer["timings"]["draft_n"] > 0, answer
    REFERENCE_COMPARISONS.append("llama-server --models-preset three tags")

    # every tag measured with its own drafter, the fastest named (which one is the machine's: not asserted)
    text = tmp_path / "wiki.txt"
    text.write_text("The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 120)
    proc, doc = run_tune(folder, "--tags", "all", "--quick", "--n-max", "2", "--methods", "drafters", "--quality", text,
                         "--plot", "--json", "--", "-t", "1",
                         env={"LLAMA_PERPLEXITY": str(reference.llama_bin("llama-perplexity"))})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [c["tag"] for c in doc["comparison"]] == list(TAGS) and doc["fastest"] in TAGS, doc["comparison"]
    assert [c["drafter"] for c in doc["comparison"]] == [f"dflash-qwen3-tiny-spm-{t}.gguf" for t in TAGS]
    assert all(c["best_tps"] and c["alone_tps"] for c in doc["comparison"]), doc["comparison"]
    quality = {t["tag"]: t for t in doc["quality"]["tags"]}
    assert set(quality) >= set(TAGS) and all(t["kld_mean"] >= 0 for t in quality.values())
    assert all(quality[t]["generation_tokens_per_second"] for t in TAGS), quality  # beside tune's speed per tag
    assert doc["plot"] is None or Path(doc["plot"]).name == "tags.png"
    recorded = json.loads((folder / "pair.json").read_text())
    assert recorded["tag_tuning"]["fastest"] == doc["fastest"] and recorded["serve"]["measured"] is True
    card = run_cli("dflash-gguf", "publish", folder, REPO, "--license", "mit", "--dry-run").stdout
    assert "### Each tag with its drafter" in card and f"**{doc['fastest']}**" in card, card
    REFERENCE_COMPARISONS.append("llama-server tune --tags three tags")
