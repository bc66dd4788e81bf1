"""``dflash-gguf publish``: an output folder on the loopback Hub through the real ``huggingface_hub`` client (create
repo, preupload, LFS batch and upload, commit), downloaded back file by file, served by b11434's ``llama-server -hf``
from there; re-publishing uploads nothing, a changed file only itself; a pair verify refuses, or one whose card
license cannot be told, is refused; the token appears in no output and no file."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import fixtures as mf
import hub_server
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli
from fixtures.gemma4_assistant import make_gemma4_assistant

from dflash_gguf.convert.targets import convert_target

TOKEN = "hf_publishTestToken0123456789abcdef"
REPO = "me/gemma-4-tiny-it-DFlash-GGUF"


def _publish(hub: hub_server.FakeHub, home: Path, *args: str | Path) -> tuple[int, str]:
    env = hub_server.client_env(hub.url, home) | {"HF_TOKEN": TOKEN}
    run = run_cli("dflash-gguf", "publish", *args, env=env)
    return run.returncode, run.stdout + run.stderr


def _recorded(folder: Path) -> dict[str, str]:
    """Every GGUF pair.json records, by its path in the folder, with its sha256."""
    doc = json.loads((folder / "pair.json").read_text())
    outs = doc["outputs"]
    return {o["file"]: o["sha256"] for o in (outs["target"], outs["drafter"], *outs.get("drafters", []))}


def _download(hub: hub_server.FakeHub, repo: str, into: Path) -> Path:
    """The repo through the real client into an empty cache."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, cache_dir=into, endpoint=hub.url, token=TOKEN))


def test_publish_download_and_republish(demo_pair: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(demo_pair, tmp_path / "pair"))
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        code, out = _publish(hub, tmp_path / "hf", folder, REPO, "--license", "apache-2.0", "--private")
        assert code == 0, out
        repo = hub.repos[REPO]
        assert repo.private and len(hub.commits()) == 1
        snapshot = _download(hub, REPO, tmp_path / "cache")
        for name, sha in _recorded(folder).items():  # every GGUF as pair.json recorded it
            assert hashlib.sha256((snapshot / name).read_bytes()).hexdigest() == sha, name
        assert {p.name for p in snapshot.iterdir()} == {*_recorded(folder), "models.ini", "pair.json", "README.md"}
        card = (snapshot / "README.md").read_text()
        assert f"llama-server -hf {REPO} --spec-type draft-dflash" in card and "not a standalone" in card
        assert "license: \"apache-2.0\"" in card and "**Verified:**" in card and "Not measured" in card
        uploads = hub.uploads()
        assert len(uploads) == 2  # the two GGUFs went up through LFS

        code, out = _publish(hub, tmp_path / "hf", folder, REPO, "--license", "apache-2.0")
        assert code == 0 and "nothing uploaded" in out, out
        assert len(hub.commits()) == 1 and hub.uploads() == uploads

        (folder / "models.ini").write_text((folder / "models.ini").read_text() + "; edited\n")
        code, out = _publish(hub, tmp_path / "hf", folder, REPO, "--license", "apache-2.0")
        # the preset, and the card that lists its sha256
        assert code == 0 and out.count("uploaded  ") == 2 and "uploaded  models.ini" in out, out
        assert "uploaded  README.md" in out
        assert len(hub.commits()) == 2 and hub.uploads() == uploads  # no GGUF sent again
        assert repo.files["models.ini"].endswith(b"; edited\n")
        _assert_no_token(out, folder, repo.files)


def test_dry_run_touches_nothing(demo_pair: Path, tmp_path: Path) -> None:
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        code, out = _publish(hub, tmp_path / "hf", demo_pair, REPO, "--license", "mit", "--dry-run")
        assert code == 0, out
        assert hub.requests == [] and REPO not in hub.repos
    assert out.startswith("---\nlicense: \"mit\"") and "dry run: nothing uploaded." in out
    assert "dflash-gemma-4-tiny-it-Q8_0.gguf" in out and "model card" in out
    _assert_no_token(out, demo_pair, {})


def test_a_license_is_asked_for_when_the_sources_disagree(demo_pair: Path, tmp_path: Path) -> None:
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        code, out = _publish(hub, tmp_path / "hf", demo_pair, REPO)
        assert hub.requests == []
    assert code == 21 and "--license ID" in out and "apache-2.0" in out and "none stated" in out, out


def test_a_pair_verify_refuses_is_not_published(tmp_path: Path) -> None:
    """A target re-trained from the one the drafter was converted for (same names and tokenizer, other weights):
    the run keeps its files but verify refuses the pair (the recorded embedding fingerprint), so publish does too,
    unless --allow-unverified, and then the card says why."""
    target = mf.make_gemma4_target(tmp_path / "targets")
    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    retrained = Path(shutil.copytree(target, tmp_path / "retrained" / target.name))
    rng = np.random.default_rng(7)
    tensors = {}
    for name, _dtype, shape, raw in mf.read_safetensors_raw(retrained / "model.safetensors"):
        widened = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
        tensors[name] = rng.normal(0, 0.02, shape).astype(np.float32) if "embed_tokens" in name else widened
    mf.write_safetensors(retrained / "model.safetensors", tensors)
    other = tmp_path / "gemma-4-tiny-it-BF16.gguf"
    convert_target(retrained, other, "bf16")
    folder = tmp_path / "pair"
    made = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", folder,
                   "--target-gguf", other)
    assert made.returncode == 1 and "lineage.fingerprint" in made.stdout + made.stderr, made.stdout + made.stderr
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        code, out = _publish(hub, tmp_path / "hf", folder, REPO, "--license", "apache-2.0")
        assert code == 21 and "verify refuses the pair" in out and "--allow-unverified" in out, out
        assert REPO not in hub.repos
        code, out = _publish(hub, tmp_path / "hf", folder, REPO, "--license", "apache-2.0", "--allow-unverified")
        assert code == 0, out
        card = hub.repos[REPO].files["README.md"].decode()
    assert "**Not verified:**" in card and "`lineage.fingerprint`" in card


def test_a_changed_file_is_refused(demo_pair: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(demo_pair, tmp_path / "pair"))
    target = next(p for p in folder.glob("*.gguf") if not p.name.startswith("dflash-"))
    target.write_bytes(target.read_bytes()[:-1] + b"\x01")
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        code, out = _publish(hub, tmp_path / "hf", folder, REPO, "--license", "mit", "--allow-unverified")
    assert code == 21 and "not the file pair.json recorded" in out, out


def test_without_a_token_the_hub_refuses_with_the_way_out(demo_pair: Path, tmp_path: Path) -> None:
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        env = hub_server.client_env(hub.url, tmp_path / "hf")
        run = run_cli("dflash-gguf", "publish", demo_pair, REPO, "--license", "mit", env=env)
    assert run.returncode == 11 and "HTTP 401" in run.stderr and "HF_TOKEN" in run.stderr, run.stderr


def test_a_dflash_drafter_and_an_mtp_assistant_folder(tmp_path: Path) -> None:
    """A run of two drafters: the served sidecar at the root; with --all-drafters the drafters/ folder beside it."""
    target = mf.make_gemma4_target(tmp_path / "targets")
    dflash = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    assistant = make_gemma4_assistant(tmp_path / "a")
    folder = tmp_path / "pair"
    made = run_cli("dflash-convert", "--target", target, "--drafter", dflash, "--drafter", assistant,
                   "--outdir", folder)
    assert made.returncode == 0, made.stdout + made.stderr
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        code, out = _publish(hub, tmp_path / "hf", folder, REPO, "--license", "apache-2.0", "--all-drafters")
        assert code == 0, out
        snapshot = _download(hub, REPO, tmp_path / "cache")
        uploads = hub.uploads()
    for name, sha in _recorded(folder).items():
        assert hashlib.sha256((snapshot / name).read_bytes()).hexdigest() == sha, name
    assert sorted(p.name for p in (snapshot / "drafters").iterdir()) == sorted(
        Path(n).name for n in _recorded(folder) if n.startswith("drafters/"))
    assert len(set(uploads)) == 3  # the contents of the target, the DFlash and the MTP drafter
    card = (snapshot / "README.md").read_text()
    assert "- \"dflash\"" in card and "- \"mtp\"" in card and "an MTP head (draft-mtp)" in card


@pytest.mark.reference
def test_llama_server_serves_the_published_repo(tmp_path: Path) -> None:
    """What publish put on the Hub is what b11434's ``llama-server -hf REPO --spec-type draft-dflash`` fetches and
    drafts with (the ~100%-acceptance pair)."""
    from test_serve_layout import REPO as SERVED
    from test_serve_layout import _assert_drafts_with_the_sidecar, _serve_from_hub

    reference.require_or_skip(reference.llama_cpp_available())
    fx = mf.make_acceptance_fixture(tmp_path / "fx")
    folder = tmp_path / "out" / "qwen3-tiny-spm"
    made = run_cli("dflash-convert", "--target", fx.target, "--drafter", fx.drafter, "--outdir", folder)
    assert made.returncode == 0, made.stdout + made.stderr
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        code, out = _publish(hub, tmp_path / "hf", folder, SERVED, "--license", "mit")
        assert code == 0, out
        published = dict(hub.repos[SERVED].files)
    served = _serve_from_hub(published, ["-hf", SERVED, "--spec-type", "draft-dflash"], tmp_path / "serve")
    _assert_drafts_with_the_sidecar(served)
    REFERENCE_COMPARISONS.append("llama-server -hf/published-repo")


def _assert_no_token(out: str, folder: Path, published: dict[str, bytes]) -> None:
    assert TOKEN not in out
    for path in folder.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
    for name, data in published.items():
        assert TOKEN.encode() not in data, name


@pytest.mark.reference
def test_llama_server_serves_a_published_mtp_assistant(tmp_path: Path) -> None:
    """A Gemma-4 target with its MTP assistant, published: ``llama-server -hf REPO --spec-type draft-mtp`` fetches
    the target and the mtp- sidecar from the Hub and drafts with it."""
    from test_serve_layout import PROMPT, _server_env

    from dflash_gguf.llama_bin import FoundBinary
    from dflash_gguf.tune.server import serve as run_llama_server

    reference.require_or_skip(reference.llama_cpp_available())
    target = mf.make_gemma4_target(tmp_path / "targets")
    folder = tmp_path / "out" / "gemma-4-tiny-it"
    made = run_cli("dflash-convert", "--target", target, "--drafter", make_gemma4_assistant(tmp_path / "a"),
                   "--outdir", folder)
    assert made.returncode == 0, made.stdout + made.stderr
    sidecar = next(p.name for p in folder.glob("mtp-*.gguf"))
    binary = FoundBinary(reference.llama_bin("llama-server"), "test")
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        code, out = _publish(hub, tmp_path / "hf", folder, REPO, "--license", "apache-2.0")
        assert code == 0, out
        hub.requests.clear()
        with run_llama_server(binary, ["-hf", REPO, "--spec-type", "draft-mtp", "-t", "1", "-c", "1024"],
                              startup_timeout=180, env=_server_env(hub, tmp_path / "serve"),
                              workdir=tmp_path) as server:
            status, body = server.request("/completion", PROMPT, timeout=120)
        downloads = hub.downloads()
    assert status == 200 and isinstance(body, dict), (status, body, server.log()[-3000:])
    assert body["timings"]["draft_n"] > 0, body["timings"]
    assert sidecar in downloads and target.name + "-Q4_0.gguf" in downloads, downloads
    REFERENCE_COMPARISONS.append("llama-server -hf/published-mtp-assistant")
