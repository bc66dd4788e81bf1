"""Repo ids through the real huggingface_hub client against a loopback Hub: pinning, selection, errors, resume,
offline. Each scenario runs in a subprocess because the client reads HF_* variables once, at import."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import fixtures as mf
import pytest
from hub_server import FakeHub, FakeRepo, client_env, fake_hub, serve

CLI = str(Path(sys.executable).parent / "dflash-gguf")
ORG = "acme/tiny-7B"


def _repo(folder: Path) -> FakeRepo:
    return FakeRepo({p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})


def _env(endpoint: str, home: Path, **extra: str) -> dict[str, str]:
    return client_env(endpoint, home) | {"HF_HUB_DISABLE_TELEMETRY": "1"} | extra


def _run(args: list[str], endpoint: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], env=_env(endpoint, home), capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


PRELUDE = """
import hashlib
import json
from pathlib import Path
from dflash_gguf import hub
from dflash_gguf.errors import DflashGgufError
out = {}
try:
%s
except DflashGgufError as e:
    out["error"] = {"class": type(e).__name__, "exit_code": e.exit_code, "message": str(e),
                    "repo": getattr(e, "repo", None), "revision": getattr(e, "revision", None)}
print(json.dumps(out, default=str))
"""


def _py(body: str, endpoint: str, home: Path, **env: str) -> dict[str, Any]:
    """Run ``body`` (Python using ``hub`` and filling ``out``) in a fresh interpreter with the Hub env."""
    code = PRELUDE % textwrap.indent(textwrap.dedent(body), "    ")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(endpoint, home, **env), capture_output=True,
                          text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"stderr": proc.stderr}


def _blob(seed: str, n: int) -> bytes:
    return hashlib.shake_256(seed.encode()).digest(n)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _files(version: str = "v1", shard_size: int = 300_000) -> dict[str, bytes]:
    """A sharded safetensors repo with every kind of file a real one carries that we must not download."""
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = {"metadata": {"total_size": 0}, "weight_map": {"a.weight": shards[0], "b.weight": shards[1]}}
    return {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "version": version}).encode(),
        "README.md": f"---\nlicense: apache-2.0\n---\n# tiny {version}\n".encode(),
        "tokenizer.json": b'{"model": {"type": "BPE"}}',
        "tokenizer_config.json": b"{}",
        "generation_config.json": b"{}",
        ".gitattributes": b"*.safetensors filter=lfs\n",
        "model.safetensors.index.json": json.dumps(index).encode(),
        shards[0]: _blob(f"{version}-1", shard_size),
        shards[1]: _blob(f"{version}-2", 120_000),
        "consolidated.safetensors": _blob(f"{version}-c", 50_000),  # a second copy, not in the index
        "pytorch_model.bin": _blob("bin", 4000),
        "training_args.pt": _blob("pt", 100),
        "original/consolidated.00.pth": _blob("pth", 100),
        "onnx/model.onnx": _blob("onnx", 100),
        "onnx/model.safetensors": _blob("onnx-st", 100),
        "tiny-7B-Q8_0.gguf": _blob(f"{version}-gguf", 70_000),
    }


WANTED = {"config.json", "README.md", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
          "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
NEVER = ("*.bin", "*.pt", "*.pth", "*.onnx", "*.gguf", "onnx/*", "consolidated.safetensors")

FETCH_ALL = """
r = hub.resolve(SPEC)
out["resolved"] = [str(r.path), r.repo, r.commit]
pats = hub.CARD_AND_CONFIG + hub.TOKENIZER_PATTERNS + hub.WEIGHT_PATTERNS
out["listed"] = {f.path: f.size for f in hub.list_files(r, pats)}
out["local_before"] = sorted(f.path for f in hub.list_files(r, pats) if f.local)
f = hub.fetch(r, pats, progress=False)
out["local_after"] = sorted(f.path for f in hub.list_files(r, pats) if f.local)
out["fetched"] = [str(f.path), f.repo, f.commit]
out["files"] = {p.relative_to(f.path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in f.path.rglob("*") if p.is_file()}
"""


def _fetch_all(spec: str, url: str, home: Path, **env: str) -> dict[str, Any]:
    return _py(f"SPEC = {spec!r}\n" + FETCH_ALL, url, home, **env)


def _assert_never_requested(hub: FakeHub) -> None:
    for pattern in NEVER:
        assert not hub.requested(pattern), (pattern, hub.requested(pattern))


def _assert_error(out: dict[str, Any], cls: str, code: int, *names: str) -> str:
    err = out.get("error")
    assert err is not None, out
    assert (err["class"], err["exit_code"]) == (cls, code), err
    for name in names:
        assert name in err["message"], (name, err["message"])
    assert "\n" not in err["message"]
    return str(err["message"])


def test_precheck_catches_a_qat_target_before_any_weights(tmp_path: Path) -> None:
    drafter = mf.make_drafter(tmp_path / "d", target="gemma4")
    vanilla = mf.make_gemma4_target(tmp_path / "v")
    qat = mf.make_gemma4_target(tmp_path / "q", qat=True)
    repos = {"z-lab/gemma4-12B-it-DFlash": _repo(drafter), "google/gemma-4-12B-it": _repo(vanilla),
             "google/gemma-4-12B-it-qat-q4_0-unquantized": _repo(qat)}
    with fake_hub(repos) as url:
        bad = _run(["precheck", "z-lab/gemma4-12B-it-DFlash", "google/gemma-4-12B-it-qat-q4_0-unquantized",
                    "--json"], url, tmp_path / "hf")
        good = _run(["precheck", "z-lab/gemma4-12B-it-DFlash", "google/gemma-4-12B-it"], url, tmp_path / "hf")
        missing = _run(["precheck", "z-lab/gemma4-12B-it-DFlash", "google/nope"], url, tmp_path / "hf")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    report = json.loads(bad.stdout)
    assert {c["id"]: c["status"] for c in report["checks"]}["lineage.derived_target"] == "fail"
    qat_sha = repos["google/gemma-4-12B-it-qat-q4_0-unquantized"].sha
    assert report["sources"]["target"] == f"google/gemma-4-12B-it-qat-q4_0-unquantized@{qat_sha}"
    assert good.returncode == 0, good.stdout + good.stderr
    assert missing.returncode == 9 and "Repository google/nope was not found" in missing.stderr
    cached = {p.name for p in (tmp_path / "hf").rglob("*") if p.is_file() or p.is_symlink()}
    assert "model.safetensors" not in cached and "tokenizer.json" not in cached  # configs and cards only


def test_fetch_pins_one_commit_and_only_the_files_needed(tmp_path: Path) -> None:
    repo = FakeRepo(_files())
    with serve({ORG: repo}) as hub:
        out = _fetch_all(ORG, hub.url, tmp_path / "hf")
    assert "error" not in out, out
    path, name, commit = out["resolved"]
    assert (name, commit) == (ORG, repo.sha) and Path(path).name == repo.sha
    assert out["fetched"] == out["resolved"]
    # byte-identical, and exactly the wanted files: no pickles, no second copy, nothing from subfolders
    assert set(out["files"]) == WANTED
    assert all(h == _sha(repo.files[p]) for p, h in out["files"].items())
    assert out["listed"] == {p: len(repo.files[p]) for p in WANTED}
    # what a plan would count as already here: config, card and the index listing fetched; all after fetch
    assert out["local_before"] == ["README.md", "config.json", "model.safetensors.index.json"]
    assert out["local_after"] == sorted(WANTED)
    _assert_never_requested(hub)
    # one resolution of main; every file was asked for at the pinned commit
    resolves = [r.path for r in hub.requests if "/resolve/" in r.path]
    assert resolves and all(f"/resolve/{repo.sha}/" in p for p in resolves), resolves
    assert [r.path for r in hub.requests if r.path.startswith("/api/")].count(f"/api/models/{ORG}/revision/main") == 1
    # the weights went through the CDN origin, as LFS files do on the Hub
    assert {r.path.rsplit("/", 1)[-1] for r in hub.requests if r.origin == "cdn"} == {
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}


def test_resolve_fetches_config_and_card_only(tmp_path: Path) -> None:
    repo = FakeRepo(_files())
    with serve({ORG: repo}) as hub:
        out = _py(f"r = hub.resolve({ORG!r}); out['files'] = sorted(p.name for p in r.path.iterdir())",
                  hub.url, tmp_path / "hf")
    assert out["files"] == ["README.md", "config.json"], out
    assert set(hub.downloads()) == {"README.md", "config.json"}


def test_a_pinned_revision_is_kept_while_main_moves(tmp_path: Path) -> None:
    repo = FakeRepo(_files("v1"))
    old = repo.sha
    repo.tag("v1.0", old)
    with serve({ORG: repo}) as hub:
        # a run pins main, then main moves before the weights are fetched (a resumed run reads pair.json)
        pinned = _py(f"r = hub.resolve({ORG!r}); out['commit'] = r.commit", hub.url, tmp_path / "hf")
        new = repo.push(_files("v2"))
        later = _py(f"""
            r = hub.Resolved(Path("unused"), {ORG!r}, {pinned["commit"]!r})
            f = hub.fetch(r, hub.WEIGHT_PATTERNS + hub.CARD_AND_CONFIG, progress=False)
            out["commit"] = f.commit
            out["config"] = (f.path / "config.json").read_text()
            out["shard"] = hashlib.sha256((f.path / "model-00001-of-00002.safetensors").read_bytes()).hexdigest()
            out["sizes"] = {{x.path: x.size for x in hub.list_files(r, hub.WEIGHT_PATTERNS)}}
            """, hub.url, tmp_path / "hf")
        by_sha = _fetch_all(f"{ORG}@{old}", hub.url, tmp_path / "hf2")
        by_tag = _py(f"out['commit'] = hub.resolve('{ORG}@v1.0').commit", hub.url, tmp_path / "hf3")
        latest = _py(f"out['commit'] = hub.resolve({ORG!r}).commit", hub.url, tmp_path / "hf")
        info = _py(f"""
            from huggingface_hub import HfApi
            i = HfApi().model_info({ORG!r}, revision={old!r}, files_metadata=True)
            out["sha"], out["sizes"] = i.sha, {{x.rfilename: x.size for x in i.siblings}}
            out["main"] = HfApi().model_info({ORG!r}).sha
            """, hub.url, tmp_path / "hf4")
    assert new != old and pinned["commit"] == old
    assert later["commit"] == old and json.loads(later["config"])["version"] == "v1"
    assert later["shard"] == _sha(repo.commits[old]["model-00001-of-00002.safetensors"])
    assert later["sizes"]["model-00001-of-00002.safetensors"] == 300_000
    assert "error" not in by_sha and by_sha["resolved"][2] == old
    assert by_sha["files"]["config.json"] == _sha(repo.commits[old]["config.json"])
    assert by_tag["commit"] == old and latest["commit"] == new
    assert not any(f"/resolve/{new}/" in r.path and "safetensors" in r.path for r in hub.requests)
    # the loopback Hub's model info (what other callers of the client see): sha and sizes per revision
    assert info["sha"] == old and info["main"] == new
    assert info["sizes"] == {p: len(b) for p, b in repo.commits[old].items()}


def test_missing_repo_and_unknown_revision(tmp_path: Path) -> None:
    with serve({ORG: FakeRepo(_files())}) as hub:
        missing = _py("hub.resolve('acme/nope')", hub.url, tmp_path / "hf")
        norev = _py(f"hub.resolve('{ORG}@v9')", hub.url, tmp_path / "hf")
        nosha = _py(f"hub.resolve('{ORG}@{'0' * 40}')", hub.url, tmp_path / "hf")
    msg = _assert_error(missing, "RepoNotFoundError", 9, "Repository acme/nope was not found", "HF_TOKEN", "repo id")
    assert "revision main" in msg
    _assert_error(norev, "RevisionNotFoundError", 12, ORG, "'v9'", "branch, tag or commit")
    assert (missing["error"]["repo"], norev["error"]["repo"], norev["error"]["revision"]) == ("acme/nope", ORG, "v9")
    _assert_error(nosha, "RevisionNotFoundError", 12, ORG, "0" * 40)


def test_gated_and_private_repos(tmp_path: Path) -> None:
    repos = {"acme/gated": FakeRepo(_files(), gated=True, tokens={"hf_granted"}),
             "acme/private": FakeRepo(_files(), private=True, tokens={"hf_granted"}), ORG: FakeRepo(_files())}
    with serve(repos, valid_tokens={"hf_granted", "hf_other"}) as hub:
        anonymous = _py("hub.resolve('acme/gated')", hub.url, tmp_path / "a")
        refused = _py("hub.resolve('acme/gated')", hub.url, tmp_path / "b", HF_TOKEN="hf_other")
        granted = _py("out['commit'] = hub.resolve('acme/gated').commit", hub.url, tmp_path / "c",
                      HF_TOKEN="hf_granted")
        private = _py("hub.resolve('acme/private')", hub.url, tmp_path / "d")
        private_ok = _py("out['commit'] = hub.resolve('acme/private').commit", hub.url, tmp_path / "e",
                         HF_TOKEN="hf_granted")
        bad_token = _py("hub.resolve('acme/gated')", hub.url, tmp_path / "f", HF_TOKEN="hf_forged")
        cli = _run(["precheck", ORG, "acme/gated"], hub.url, tmp_path / "g")
        auths = {r.authorization for r in hub.requests if "/resolve/" in r.path}
    _assert_error(anonymous, "RepoAccessError", 11, "acme/gated", "revision main", "HTTP 401", "license",
                  "HF_TOKEN")
    _assert_error(refused, "RepoAccessError", 11, "acme/gated", "HTTP 403", "not been granted", "accept the license")
    assert granted["commit"] == repos["acme/gated"].sha
    _assert_error(private, "RepoNotFoundError", 9, "acme/private", "private", "HF_TOKEN")
    assert private_ok["commit"] == repos["acme/private"].sha
    _assert_error(bad_token, "RepoAccessError", 11, "acme/gated", "invalid", "HF_TOKEN")
    assert None in auths and "Bearer hf_granted" in auths  # HF_TOKEN is what the client sent
    assert cli.returncode == 11 and "acme/gated (revision main) is a gated repo" in cli.stderr, cli.stderr


def test_a_cut_download_resumes_with_a_range_request(tmp_path: Path) -> None:
    # the client writes what it received in 10 MiB chunks: a cut after 11 MiB resumes from 10 MiB
    repo = FakeRepo(_files(shard_size=12 * 2**20))
    shard = "model-00001-of-00002.safetensors"
    with serve({ORG: repo}) as hub:
        hub.cut(shard, after=11 * 2**20)
        out = _fetch_all(ORG, hub.url, tmp_path / "hf")
        ranges = [r.range for r in hub.requests if r.path.endswith(shard) and r.method == "GET"]
    assert "error" not in out, out
    assert out["files"][shard] == _sha(repo.files[shard])
    assert ranges == [None, f"bytes={10 * 2**20}-"]
    assert not list((tmp_path / "hf").rglob("*.incomplete"))


def test_a_download_cut_for_good_fails_then_the_next_fetch_completes(tmp_path: Path) -> None:
    repo = FakeRepo(_files())
    shard = "model-00002-of-00002.safetensors"
    with serve({ORG: repo}) as hub:
        hub.cut(shard, after=0, times=50)  # every attempt dies: the client gives up
        failed = _fetch_all(ORG, hub.url, tmp_path / "hf")
        hub.cuts.clear()
        before = len(hub.requests)
        again = _fetch_all(ORG, hub.url, tmp_path / "hf")
        fetched_again = [r.path.rsplit("/", 1)[-1] for r in hub.requests[before:] if r.method == "GET"
                         and ("/resolve/" in r.path or r.origin == "cdn")]
    _assert_error(failed, "DownloadError", 14, ORG, shard, "Re-run")
    assert "error" not in again, again
    assert again["files"][shard] == _sha(repo.files[shard])
    # files completed by the failed run stay in the cache: only the cut shard is downloaded again
    assert fetched_again == [shard], fetched_again
    assert not list((tmp_path / "hf").rglob("*.incomplete"))


def test_offline_with_a_warm_cache_and_without_one(tmp_path: Path) -> None:
    repo = FakeRepo(_files())
    home = tmp_path / "hf"
    with serve({ORG: repo}) as hub:
        online = _fetch_all(ORG, hub.url, home)
        partial = _py(f"hub.resolve({ORG!r})", hub.url, tmp_path / "cold")  # config and card only
        _py(f"hub.resolve({ORG!r})", hub.url, tmp_path / "old")
        shutil.rmtree(next((tmp_path / "old").rglob("trees")))  # a cache written before the client kept tree lists
        seen = len(hub.requests)
        warm = _py(f"""
            f = hub.fetch(hub.Resolved(Path("x"), {ORG!r}, {repo.sha!r}), hub.WEIGHT_PATTERNS + hub.CARD_AND_CONFIG)
            out["n"] = len(hub.list_files(f, hub.WEIGHT_PATTERNS))
            """, hub.url, home)
        assert warm.get("n") == 3 and hub.requests[seen:] == []  # a pinned commit in a warm cache: no request
        offline = _fetch_all(ORG, hub.url, home, HF_HUB_OFFLINE="1")
        pinned = _fetch_all(f"{ORG}@{repo.sha}", hub.url, home, HF_HUB_OFFLINE="1")
        cold = _fetch_all(ORG, hub.url, tmp_path / "empty", HF_HUB_OFFLINE="1")
        lacking = _fetch_all(ORG, hub.url, tmp_path / "cold", HF_HUB_OFFLINE="1")
        old_cache = _fetch_all(ORG, hub.url, tmp_path / "old", HF_HUB_OFFLINE="1")
        offline_requests = hub.requests[seen:]
    assert "error" not in online and "error" not in partial
    assert offline_requests == []
    assert offline["resolved"][2] == repo.sha and offline["files"] == online["files"]
    assert offline["listed"] == online["listed"]
    assert pinned["fetched"][2] == repo.sha
    _assert_error(cold, "HubOfflineError", 13, ORG, "HF_HUB_OFFLINE", "not in the local Hugging Face cache")
    _assert_error(lacking, "HubOfflineError", 13, ORG, "HF_HUB_OFFLINE", "model-00001-of-00002.safetensors")
    _assert_error(old_cache, "HubOfflineError", 13, ORG, "HF_HUB_OFFLINE", "safetensors")


def test_an_unreachable_hub_without_a_cache(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    out = _py(f"hub.resolve({ORG!r})", url, tmp_path / "hf")
    _assert_error(out, "HubOfflineError", 13, ORG, "Cannot reach the Hub", url, "HF_ENDPOINT")


def test_list_files_of_a_folder_matches_the_hub(tmp_path: Path) -> None:
    repo = FakeRepo(_files())
    folder = tmp_path / "local"
    for name, data in repo.files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    with serve({ORG: repo}) as hub:
        out = _py(f"""
            pats = hub.CARD_AND_CONFIG + hub.TOKENIZER_PATTERNS + hub.WEIGHT_PATTERNS
            out["hub"] = {{f.path: f.size for f in hub.list_files(hub.resolve({ORG!r}), pats)}}
            local = hub.resolve({str(folder)!r})
            out["local"] = {{f.path: f.size for f in hub.list_files(local, pats)}}
            out["same"] = hub.fetch(local, pats) == local
            """, hub.url, tmp_path / "hf")
    assert out["hub"] == out["local"] == {p: len(repo.files[p]) for p in WANTED}
    assert out["same"] is True
    assert not hub.requested("*.safetensors")  # listing needs the index, never a shard


def test_fetch_file_for_a_gguf_in_a_repo(tmp_path: Path) -> None:
    repo = FakeRepo(_files())
    local = tmp_path / "t.gguf"
    local.write_bytes(b"GGUF")
    with serve({ORG: repo}) as hub:
        out = _py(f"""
            out["main"] = str(hub.fetch_file("{ORG}:tiny-7B-Q8_0.gguf").path)
            out["pinned"] = str(hub.fetch_file("{ORG}@{repo.sha}:tiny-7B-Q8_0.gguf").path)
            out["local"] = str(hub.fetch_file({str(local)!r}).path)
            out["spec"] = hub.fetch_file("{ORG}:tiny-7B-Q8_0.gguf").spec
            """, hub.url, tmp_path / "hf")
        missing = _py(f"hub.fetch_file('{ORG}:tiny-7B-Q4_0.gguf')", hub.url, tmp_path / "hf")
        bad = _py("hub.fetch_file('no such thing')", hub.url, tmp_path / "hf")
    assert "error" not in out, out
    assert Path(out["main"]).read_bytes() == repo.files["tiny-7B-Q8_0.gguf"]
    assert Path(out["pinned"]).parent.name == repo.sha and out["local"] == str(local)
    assert out["spec"] == f"{ORG}@{repo.sha}:tiny-7B-Q8_0.gguf"  # pinned: how a published record names it
    _assert_error(missing, "RepoNotFoundError", 9, "tiny-7B-Q4_0.gguf", ORG, "tiny-7B-Q8_0.gguf")
    _assert_error(bad, "InputError", 2, "no such thing", "org/name")
    assert hub.downloads().count("tiny-7B-Q8_0.gguf") == 1 and not hub.requested("*.safetensors")


@pytest.mark.parametrize("pickle_name", ["pytorch_model.bin", "model.pt"])
def test_a_repo_with_pickle_weights_only_is_refused_before_any_download(tmp_path: Path, pickle_name: str) -> None:
    files = {k: v for k, v in _files().items() if not k.endswith(".safetensors") and "index" not in k}
    files[pickle_name] = _blob("pickle", 1000)
    repo = FakeRepo(files)
    with serve({ORG: repo}) as hub:
        out = _py(f"hub.fetch(hub.resolve({ORG!r}), hub.WEIGHT_PATTERNS + hub.TOKENIZER_PATTERNS)", hub.url,
                  tmp_path / "hf")
        # the way out the message gives: the Hub's safetensors conversion on a PR branch
        pr = repo.push(_files(), branch="refs/pr/1")
        fixed = _py(f"""
            f = hub.fetch(hub.resolve("{ORG}@refs/pr/1"), hub.WEIGHT_PATTERNS)
            out["commit"] = f.commit
            out["weights"] = sorted(p.name for p in f.path.iterdir() if p.name.endswith(".safetensors"))
            """, hub.url, tmp_path / "hf")
    _assert_error(out, "UnsupportedModelError", 4, ORG, pickle_name, "safetensors", "refs/pr/")
    assert not hub.requested("*.bin") and not hub.requested("*.pt") and not hub.requested("tokenizer.json")
    assert fixed["commit"] == pr and fixed["weights"] == ["model-00001-of-00002.safetensors",
                                                          "model-00002-of-00002.safetensors"]


def test_a_gguf_only_repo_has_no_config(tmp_path: Path) -> None:
    with serve({ORG: FakeRepo({"README.md": b"# gguf", "tiny-7B-Q4_0.gguf": _blob("g", 100)})}) as hub:
        out = _py(f"hub.resolve({ORG!r})", hub.url, tmp_path / "hf")
    _assert_error(out, "ConfigError", 3, ORG, "config.json", f"--target-gguf {ORG}:tiny-7B-Q4_0.gguf")
    assert not hub.requested("*.gguf")


def test_progress_bars_go_to_stderr_and_progress_false_is_quiet(tmp_path: Path) -> None:
    repo = FakeRepo(_files())
    body = f"hub.fetch(hub.resolve({ORG!r}, progress=%s), hub.WEIGHT_PATTERNS, progress=%s)"
    with serve({ORG: repo}) as hub:  # TQDM_POSITION=-1 shows the client's bars without a terminal
        loud = _py(body % (True, True), hub.url, tmp_path / "a", TQDM_POSITION="-1")
        quiet = _py(body % (False, False), hub.url, tmp_path / "b", TQDM_POSITION="-1")
    assert "error" not in loud and "error" not in quiet
    assert "Fetching 2 files" in loud["stderr"] and "Fetching 3 files" in loud["stderr"], loud["stderr"]
    assert "Fetching" not in quiet["stderr"] and "Download" not in quiet["stderr"], quiet["stderr"]
