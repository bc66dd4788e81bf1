"""What publish puts on the Hub carries nothing of this machine, holds the importance matrix the target was made
with, and goes up alone as a drafter for a target someone else publishes.

- A pair made, measured and published from a folder under a planted user name and host name (HOME pointing there):
  neither, nor the home folder, the temp folder or the llama.cpp build's folder, is in any uploaded byte (GGUF
  tensor data and metadata included). An importance matrix made with its text given by an absolute path travels
  into the target GGUF through llama-quantize; publish then refuses (exit 22) naming the key, and uploads nothing.
- ``--target-gguf REPO:FILE`` from another publisher's repo: publish uploads the drafter alone with a card naming
  that repo at its commit; b11434's ``llama-server -hf THEIRS:Q4_0 -hfd OURS:Q8_0`` serves and drafts with it,
  and the target's repo is not written to.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import fixtures as mf
import hub_server
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli, run_cli_process, run_tune
from hub_server import FakeRepo

from dflash_gguf.errors import PrivateDataRefused
from dflash_gguf.ggufio.reader import read_gguf

TOKEN = "hf_privateTestToken0123456789abcdef"
USER = "planted-user-q7x"
HOST = "planted-host-k3z"
REPO = "me/gemma-4-tiny-it-DFlash-GGUF"
THEIRS = "someone-else/qwen3-tiny-spm-GGUF"
THEIR_FILE = "qwen3-tiny-spm-Q4_0.gguf"
OURS = "me/qwen3-tiny-spm-DFlash-GGUF"
TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def _publish(hub: hub_server.FakeHub, hf_home: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    env = hub_server.client_env(hub.url, hf_home) | {"HF_TOKEN": TOKEN}
    return run_cli("dflash-gguf", "publish", *args, env=env)


def _imatrix(gguf: Path, text: Path, out: Path, *, text_by_name: bool) -> Path:
    """b11434's llama-imatrix over ``text``, given by name from its folder, or by its absolute path."""
    proc = subprocess.run([str(reference.llama_bin("llama-imatrix")), "-m", str(gguf),
                           "-f", text.name if text_by_name else str(text), "-o", str(out), "-c", "64",
                           "--chunks", "2", "-t", "1"], cwd=text.parent, capture_output=True, text=True,
                          env=reference._bin_env(), stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


@pytest.mark.reference
def test_nothing_of_this_machine_is_published(tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    home = tmp_path / "home" / USER
    root = home / HOST / "models"
    target = mf.make_gemma4_target(root / "targets")
    drafter = mf.make_drafter(root / "drafters", target="gemma4")
    work = root / "calibration"
    work.mkdir(parents=True)
    (work / "calibration.txt").write_text(TEXT)
    made = run_cli("dflash-gguf", "convert-target", target, "--outfile", work / "t-BF16.gguf")
    assert made.returncode == 0, made.stdout + made.stderr
    careful = _imatrix(work / "t-BF16.gguf", work / "calibration.txt", work / "imatrix.gguf", text_by_name=True)
    env = {"HOME": str(home), "LLAMA_QUANTIZE": str(reference.llama_bin("llama-quantize"))}
    folder = root / "out" / "gemma-4-tiny-it"
    made = run_cli_process("dflash-convert", "--target", target, "--drafter", drafter, "--imatrix", careful,
                           "--outdir", folder, env=env)
    assert made.returncode == 0, made.stdout + made.stderr
    matrix = folder / "imatrix" / "imatrix-gemma-4-tiny-it.gguf"
    assert matrix.read_bytes() == careful.read_bytes()
    target_meta = read_gguf(folder / "gemma-4-tiny-it-Q4_0.gguf")
    assert target_meta.get("quantize.imatrix.file") == matrix.name  # llama-quantize was given it by name
    tuned, _ = run_tune(folder / "pair.json", "--n-max", "2", "--repeats", "1", "--n-predict", "8", "--methods",
                        "drafters", "--", "-t", "1")
    assert tuned.returncode in (0, 15), tuned.stderr[-3000:]  # the fixture's drafter is random: 15 is collapse

    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        proc = _publish(hub, home / ".cache" / "huggingface", folder, REPO, "--license", "apache-2.0")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        published = dict(hub.repos[REPO].files)
    assert f"imatrix/{matrix.name}" in published and "pair.json" in published and "models.ini" in published
    card = published["README.md"].decode()
    assert matrix.name in card and "llama-imatrix (2 chunks of 64 tokens on calibration.txt)" in card
    private = [USER, HOST, str(home), str(tmp_path), str(Path.home()), str(reference.env.llama_bin_dir())]
    for name, data in published.items():
        for planted in private:
            assert planted.encode() not in data, (name, planted)

    # The careless matrix: its text's path goes into the target GGUF (quantize.imatrix.dataset): refused, by key.
    careless = _imatrix(work / "t-BF16.gguf", work / "calibration.txt", work / "imatrix-abs.gguf", text_by_name=False)
    other = root / "out" / "careless"
    made = run_cli_process("dflash-convert", "--target", target, "--drafter", drafter, "--imatrix", careless,
                           "--outdir", other, env=env)
    assert made.returncode == 0, made.stdout + made.stderr
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        proc = _publish(hub, home / ".cache" / "huggingface", other, REPO, "--license", "apache-2.0")
        assert hub.requests == [] and REPO not in hub.repos
    assert proc.returncode == PrivateDataRefused.exit_code, proc.stdout + proc.stderr
    assert "metadata key quantize.imatrix.dataset" in proc.stderr and "Nothing was uploaded" in proc.stderr
    assert "by name" in proc.stderr
    REFERENCE_COMPARISONS.append("llama-imatrix + llama-quantize --imatrix/published, nothing of this machine")


def test_a_folder_from_before_is_refused_until_remade(demo_pair: Path, tmp_path: Path) -> None:
    """A pair.json naming an absolute source path (as earlier versions wrote): publish names the file, the line and
    the fix; nothing reaches the Hub."""
    folder = tmp_path / USER / "pair"
    import shutil
    shutil.copytree(demo_pair, folder)
    doc = (folder / "pair.json").read_text()
    (folder / "pair.json").write_text(doc.replace('"path": "gemma-4-tiny-it"', f'"path": "{folder.parent}/t"'))
    # the manifest's own record of pair.json is not a file it hashes: the edit is judged by the privacy check
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        proc = _publish(hub, tmp_path / "hf", folder, REPO, "--license", "mit")
        assert hub.requests == []
    assert proc.returncode == 22, proc.stdout + proc.stderr
    assert "pair.json: line" in proc.stderr and "an absolute path of this machine" in proc.stderr
    assert "re-run dflash-convert" in proc.stderr


@pytest.mark.reference
@pytest.mark.parametrize("split", [False, True], ids=["one-file", "split"])
def test_a_drafter_for_a_target_someone_else_publishes(split: bool, tmp_path: Path) -> None:
    """Their target as one file, or split in shards by b11434's llama-gguf-split (given by its first shard)."""
    reference.require_or_skip(reference.llama_cpp_available())
    from test_serve_layout import PROMPT, _server_env
    from test_split_gguf import split_gguf

    from dflash_gguf.llama_bin import FoundBinary
    from dflash_gguf.tune.server import serve as run_llama_server

    fx = mf.make_acceptance_fixture(tmp_path / "fx")
    theirs = tmp_path / "theirs" / THEIR_FILE
    theirs.parent.mkdir()
    (tmp_path / "shards").mkdir()
    made = run_cli("dflash-gguf", "convert-target", fx.target, "--quant", "q4_0", "--outfile", theirs)
    assert made.returncode == 0, made.stdout + made.stderr
    files = split_gguf(theirs, tmp_path / "shards" / theirs.stem, 5) if split else [theirs]
    their_repo = FakeRepo({p.name: p.read_bytes() for p in files} | {"README.md": b"---\nlicense: mit\n---\n"})
    folder = tmp_path / "out" / "qwen3-tiny-spm"
    with hub_server.serve({THEIRS: their_repo}, valid_tokens=[TOKEN]) as hub:
        env = hub_server.client_env(hub.url, tmp_path / "hf")
        made = run_cli_process("dflash-convert", "--target", fx.target, "--drafter", fx.drafter, "--target-gguf",
                               f"{THEIRS}:{files[0].name}", "--outdir", folder, env=env)
        assert made.returncode == 0, made.stdout + made.stderr
        proc = _publish(hub, tmp_path / "hf", folder, OURS, "--license", "mit")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ours = dict(hub.repos[OURS].files)
        assert hub.repos[THEIRS].files.keys() == {p.name for p in files} | {"README.md"}  # nothing written there
        assert len(hub.commits()) == 1
        sidecar = next(n for n in ours if n.startswith("dflash-"))
        assert set(ours) == {sidecar, "pair.json", "README.md"}, sorted(ours)
        card = ours["README.md"].decode()
        assert f"llama-server -hf {THEIRS}:Q4_0 -hfd {OURS}:Q8_0 --spec-type draft-dflash" in card, card
        assert f"file `{files[0].name}` at commit `{their_repo.sha}`" in card and f"- \"{THEIRS}\"" in card

        hub.requests.clear()
        binary = FoundBinary(reference.llama_bin("llama-server"), "test")
        args = ["-hf", f"{THEIRS}:Q4_0", "-hfd", f"{OURS}:Q8_0", "--spec-type", "draft-dflash", "-t", "1",
                "-c", "1024"]
        with run_llama_server(binary, args, startup_timeout=180, env=_server_env(hub, tmp_path / "serve"),
                              workdir=tmp_path) as server:
            status, body = server.request("/completion", PROMPT, timeout=120)
        downloads = hub.downloads()
        assert not [r for r in hub.requests if r.method in ("POST", "PUT")]
    assert status == 200 and isinstance(body, dict), (status, body, server.log()[-3000:])
    t = body["timings"]
    assert t["draft_n"] > 0 and t["draft_n_accepted"] / t["draft_n"] >= 0.9, t
    assert sorted(set(downloads)) == sorted([*(p.name for p in files), sidecar]), downloads
    REFERENCE_COMPARISONS.append(f"llama-server -hf/-hfd drafter-only repo ({'split' if split else 'one file'})")
