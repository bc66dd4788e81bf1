"""The output folder, uploaded as-is to a Hub repo, is what ``llama-server -hf org/name`` serves, drafter included.

dflash-convert writes ``<target>-Q4_0.gguf`` and the sidecar ``dflash-<target>-Q8_0.gguf`` (plus models.ini and
pair.json) because that is llama.cpp's own repo layout: b11434's ``-hf`` lists the repo
(``api/models/<repo>/refs``, then ``tree/<commit>?recursive=true``), picks the model GGUF, and finds the DFlash
sidecar by name (common/download.cpp ``find_best_dflash``: a ``dflash-`` GGUF beside the model). Here the Hub is
the loopback fake in hub_server.py and llama-server is the real b11434 one; nothing leaves 127.0.0.1 and every
cache is a tmp dir.

What b11434 does with that repo (common/arg.cpp ``common_models_handler_init``):
- ``-hf REPO[:Q4_0] --spec-type draft-dflash``: the sidecar is fetched and attached as the draft model;
- ``-hf REPO`` alone: the sidecar is NOT looked for (``download_dflash`` follows ``--spec-type``), only the
  target is fetched, and the server runs without speculative decoding;
- ``-hf REPO -hfd REPO`` (no ``--spec-type``): the draft repo is searched for every sidecar kind and the type
  is inferred from the one found, so the drafter is attached too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fixtures as mf
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli
from hub_server import FakeHub, FakeRepo, Request, serve

from dflash_gguf.llama_bin import FoundBinary
from dflash_gguf.tune.server import serve as run_llama_server

REPO = "someone/qwen3-tiny-spm-GGUF"
TARGET = "qwen3-tiny-spm-Q4_0.gguf"
SIDECAR = "dflash-qwen3-tiny-spm-Q8_0.gguf"
PROMPT = {"prompt": "hello", "n_predict": 16, "temperature": 0}


# ------------------------------------------------------------------------------------------ the fake's refs


def test_fake_hub_refs_read_by_huggingface_hub() -> None:
    """``/refs`` in the Hub's own format, as the real client parses it (llama.cpp reads ``branches`` from it)."""
    from huggingface_hub import HfApi

    repo = FakeRepo({"a.gguf": b"a"})
    first = repo.sha
    repo.tag("v1", first)
    dev = repo.push({"a.gguf": b"b"}, branch="dev")
    with serve({REPO: repo}) as hub, _no_proxy():
        refs = HfApi(endpoint=hub.url).list_repo_refs(REPO)
        with_prs = HfApi(endpoint=hub.url).list_repo_refs(REPO, include_pull_requests=True)
    assert sorted((b.name, b.ref, b.target_commit) for b in refs.branches) == [
        ("dev", "refs/heads/dev", dev), ("main", "refs/heads/main", first)]
    assert [(t.name, t.ref, t.target_commit) for t in refs.tags] == [("v1", "refs/tags/v1", first)]
    assert refs.converts == [] and with_prs.pull_requests == []


@contextlib.contextmanager
def _no_proxy() -> Iterator[None]:
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.lower() in ("http_proxy", "https_proxy", "all_proxy")}
    try:
        yield
    finally:
        os.environ.update(saved)


# ------------------------------------------------------------------------------------------ the folder


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Every file of the folder dflash-convert writes for the ~100%-acceptance pair, by name (the work area aside)."""
    reference.require_or_skip(reference.llama_cpp_available())
    work = tmp_path_factory.mktemp("serve-layout")
    fx = mf.make_acceptance_fixture(work / "fx")
    outdir = work / "out" / "qwen3-tiny-spm"
    run = run_cli("dflash-convert", "--target", fx.target, "--drafter", fx.drafter, "--outdir", outdir)
    assert run.returncode == 0, run.stdout + run.stderr
    files = {p.name: p.read_bytes() for p in outdir.iterdir() if p.is_file()}
    assert {TARGET, SIDECAR, "models.ini", "pair.json"} <= set(files), sorted(files)
    return files


# ------------------------------------------------------------------------------------------ llama-server -hf


@dataclass
class Served:
    status: int
    body: object
    log: str
    requests: list[Request]
    downloads: list[str]  # repo files whose bytes were fetched (Hub resolve or CDN GETs)
    commit: str
    cache: Path

    @property
    def timings(self) -> dict[str, float]:
        assert self.status == 200 and isinstance(self.body, dict), (self.status, self.body, self.log[-3000:])
        return self.body["timings"]

    def draft_path(self) -> str:
        """Where llama.cpp's cache puts the sidecar it downloaded."""
        return str(self.cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / self.commit / SIDECAR)


def _server_env(hub: FakeHub, tmp: Path) -> dict[str, str]:
    """b11434's binaries pointed at the fake Hub; every cache llama.cpp could pick is a tmp dir."""
    drop = ("HF_", "HUGGINGFACE_", "MODEL_ENDPOINT", "LLAMA_CACHE", "XDG_CACHE_HOME")
    env = {k: v for k, v in reference._bin_env().items()
           if not k.startswith(drop) and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    return env | {"MODEL_ENDPOINT": hub.url, "HF_ENDPOINT": hub.url, "LLAMA_CACHE": str(tmp / "llama-cache"),
                  "HF_HOME": str(tmp / "hf-home"), "XDG_CACHE_HOME": str(tmp / "xdg-cache"),
                  "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}


def _serve_from_hub(files: dict[str, bytes], args: list[str], tmp: Path) -> Served:
    """Upload ``files`` to the fake Hub as REPO, run ``llama-server ARGS`` against it, complete PROMPT once."""
    repo = FakeRepo(dict(files))
    tmp.mkdir(parents=True, exist_ok=True)
    binary = FoundBinary(reference.llama_bin("llama-server"), "test")
    with serve({REPO: repo}) as hub:
        with run_llama_server(binary, [*args, "-t", "1", "-c", "1024"], startup_timeout=180,
                              env=_server_env(hub, tmp), workdir=tmp) as server:
            status, body = server.request("/completion", PROMPT, timeout=120)
        requests, downloads = list(hub.requests), hub.downloads()
    return Served(status, body, server.log(), requests, downloads, repo.sha, tmp / "llama-cache")


def _assert_listed_the_repo(served: Served) -> None:
    """llama.cpp pinned the commit from /refs, listed the tree at it, and downloaded at that commit only."""
    paths = [r.path for r in served.requests if r.origin == "hub"]
    assert paths[:2] == [f"/api/models/{REPO}/refs", f"/api/models/{REPO}/tree/{served.commit}"], paths
    assert all(f"/resolve/{served.commit}/" in p for p in paths if "/resolve/" in p), paths
    assert "models.ini" not in served.downloads and "pair.json" not in served.downloads  # GGUFs only


def _assert_drafts_with_the_sidecar(served: Served) -> None:
    t = served.timings
    assert t["draft_n"] > 0, t
    assert t["draft_n_accepted"] / t["draft_n"] >= 0.9, t  # the acceptance pair: the drafter predicts the target
    assert sorted(set(served.downloads)) == sorted([SIDECAR, TARGET]), served.downloads
    assert f"loading draft model '{served.draft_path()}'" in served.log, served.log[-3000:]
    assert "adding speculative implementation 'draft-dflash'" in served.log


@pytest.mark.reference
@pytest.mark.parametrize("tag", ["", ":Q4_0"], ids=["no-tag", "tag-Q4_0"])
def test_hub_repo_is_served_with_the_dflash_sidecar(layout: dict[str, bytes], tag: str, tmp_path: Path) -> None:
    served = _serve_from_hub(layout, ["-hf", REPO + tag, "--spec-type", "draft-dflash"], tmp_path)
    _assert_listed_the_repo(served)
    _assert_drafts_with_the_sidecar(served)
    assert f"loading model '{REPO + tag}'" in served.log
    REFERENCE_COMPARISONS.append(f"llama-server -hf{tag or ''}/dflash-sidecar")


@pytest.mark.reference
def test_without_spec_type_the_sidecar_is_not_fetched(layout: dict[str, bytes], tmp_path: Path) -> None:
    """``-hf REPO`` alone serves the target without a drafter: b11434 only looks for the dflash- sidecar when
    ``--spec-type draft-dflash`` asks for it; the sidecar is not even HEAD-requested."""
    served = _serve_from_hub(layout, ["-hf", REPO], tmp_path)
    _assert_listed_the_repo(served)
    assert served.downloads and set(served.downloads) == {TARGET}, served.downloads
    assert not [r for r in served.requests if SIDECAR in r.path], served.requests
    assert "loading draft model" not in served.log and "draft-dflash" not in served.log
    assert served.timings.get("draft_n", 0) == 0, served.timings
    assert served.timings["predicted_n"] == PROMPT["n_predict"]  # served, just not speculatively
    REFERENCE_COMPARISONS.append("llama-server -hf/no-spec-type")


@pytest.mark.reference
def test_same_repo_as_draft_repo_infers_dflash(layout: dict[str, bytes], tmp_path: Path) -> None:
    """``-hf REPO -hfd REPO`` without ``--spec-type``: the draft repo is searched for every sidecar kind and
    the type is inferred from the dflash- one it ships, so the drafter is attached all the same."""
    served = _serve_from_hub(layout, ["-hf", REPO, "-hfd", REPO], tmp_path)
    _assert_listed_the_repo(served)
    _assert_drafts_with_the_sidecar(served)
    REFERENCE_COMPARISONS.append("llama-server -hf -hfd/dflash-inferred")
