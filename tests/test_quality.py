"""``dflash-gguf quality``: every tag of a folder against its 16-bit original, by b11434's llama-perplexity.

Asserts the structure (every tag and the base, KLD >= 0, the base against itself 0), that the numbers are the ones
llama-perplexity prints run by hand on the same files and settings, that a second run measures nothing again, and
that the card carries them. Never which tag wins.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import fixtures as mf
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli

from dflash_gguf.publish import plan_publish
from dflash_gguf.tune.quality import ATTEMPTS, parse_kld

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 120
TAGS = ("BF16", "Q4_K_M", "Q8_0")


def _base_runs(calls: Path) -> int:
    """How many of the noted llama-perplexity runs made base logits (--kl-divergence-base without --kl-divergence)."""
    return sum("--kl-divergence" not in line.split() for line in calls.read_text().splitlines())


def _by_hand(model: Path, text: Path, log: Path, *args: str) -> str:
    """llama-perplexity as a user runs it; its log file (its console loses the last lines when redirected)."""
    cmd = [str(reference.llama_bin("llama-perplexity")), "-m", str(model), "-f", text.name, "-c", "128", "-b", "128",
           "-t", "2", *args, "--log-file", str(log)]
    proc = subprocess.run(cmd, cwd=text.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env=reference._bin_env(), stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0
    return log.read_text()


@pytest.mark.reference
def test_quality_of_every_tag(tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    target = mf.make_gemma4_target(tmp_path / "targets")
    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    folder = tmp_path / "pair"
    made = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--quant", ",".join(TAGS), "--outdir",
                   folder)
    assert made.returncode == 0, made.stdout + made.stderr
    text = tmp_path / "text" / "wiki.txt"
    text.parent.mkdir()
    text.write_text(TEXT)
    counting, calls, lib = reference.noting_binary(tmp_path, "llama-perplexity")
    env = {"LLAMA_PERPLEXITY": str(counting), **lib}
    proc = run_cli("dflash-gguf", "quality", folder, "--text", text, "--threads", "2", "--plot", "--json", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert [t["tag"] for t in doc["tags"]] == ["BF16 (base)", *TAGS]
    # the Pareto front: every tag off it is beaten on both size and drift by one on it; drawn, and on the card
    rows = {t["tag"]: t for t in doc["tags"][1:]}
    front = doc["pareto_front"]
    assert front and set(front) <= set(TAGS)
    for tag in set(TAGS) - set(front):
        assert any(rows[f]["size_bytes"] <= rows[tag]["size_bytes"] and rows[f]["kld_mean"] <= rows[tag]["kld_mean"]
                   for f in front), tag
    assert doc["plot"] == "quality.png" and (folder / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = plan_publish(folder, "someone/gemma-4-tiny-GGUF", license="apache-2.0")
    assert "![quality](quality.png)" in plan.card and "quality.png" in [f.path_in_repo for f in plan.files]
    assert f"| Q8_0 | {rows['Q8_0']['size_bytes']} | {rows['Q8_0']['bits_per_weight']} | {rows['Q8_0']['kld_mean']} |" \
        in plan.card
    assert doc["base"] == "gemma-4-tiny-it-BF16.gguf" and doc["settings"] == {"ctx": 128, "batch": 128,
                                                                              "chunks": None, "threads": 2}
    assert all(t["kld_mean"] >= 0 and t["kld_p999"] >= t["kld_p99"] >= 0 and 0 <= t["same_top_p"] <= 100
               and t["ppl_ratio"] > 0 for t in doc["tags"])
    base = doc["tags"][0]
    assert base["kld_mean"] == 0 and base["same_top_p"] == 100 and base["ppl_ratio"] == 1
    for row in doc["tags"]:  # the size as on disk, and llama.cpp's BPW: tensor bits over tensor elements
        assert row["size_bytes"] == (folder / row["file"]).stat().st_size
    bpw = {t["tag"]: t["bits_per_weight"] for t in doc["tags"]}
    assert 16 <= bpw["BF16"] < 17 and bpw["Q4_K_M"] < bpw["Q8_0"] < bpw["BF16"], bpw
    # the base's logits, then the base against them (which is also the BF16 tag's result), Q4_K_M and Q8_0 (again
    # when b11434's logger lost the statistics at exit: tune.quality.measure_kld)
    runs = len(calls.read_text().splitlines())
    assert _base_runs(calls) == 1 and 4 <= runs <= 1 + 3 * ATTEMPTS

    logits = tmp_path / "base.kld"
    _by_hand(folder / "gemma-4-tiny-it-BF16.gguf", text, tmp_path / "base.log", "--kl-divergence-base", str(logits))
    for row in doc["tags"][1:]:
        hand = None
        for attempt in range(ATTEMPTS):  # as measure_kld: the statistics are now and then lost at exit
            hand = parse_kld(_by_hand(folder / row["file"], text, tmp_path / f"{row['tag']}-{attempt}.log",
                                      "--kl-divergence-base", str(logits), "--kl-divergence"))
            if hand is not None:
                break
        assert hand is not None and {k: row[k] for k in hand.to_dict()} == hand.to_dict(), row["tag"]
    REFERENCE_COMPARISONS.append("quality = llama-perplexity --kl-divergence by hand, per tag")

    again = run_cli("dflash-gguf", "quality", folder, "--text", text, "--threads", "2", "--json", env=env)
    assert again.returncode == 0 and json.loads(again.stdout)["tags"] == doc["tags"]
    assert len(calls.read_text().splitlines()) == runs  # nothing measured again: pair.json's quality answered

    # another folder of the same target, measured on the same text: the base's logits are not made again (the
    # content cache), and every number is the same
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    recorded = json.loads((other / "pair.json").read_text())
    del recorded["quality"]
    (other / "pair.json").write_text(json.dumps(recorded))
    third = run_cli("dflash-gguf", "quality", other, "--text", text, "--threads", "2", "--json", env=env)
    assert third.returncode == 0, third.stdout + third.stderr
    assert json.loads(third.stdout)["tags"] == doc["tags"]
    assert _base_runs(calls) == 1 and len(calls.read_text().splitlines()) > runs
    assert not list(folder.rglob("*.kld")) and not list(other.rglob("*.kld"))  # kept in the cache, not the folders
    recorded = json.loads((folder / "pair.json").read_text())["quality"]
    assert recorded["text"]["sha256"] == doc["text"]["sha256"] and len(recorded["tags"]) == 4
    card = run_cli("dflash-gguf", "publish", folder, "me/x", "--license", "mit", "--dry-run").stdout
    assert "## Quality" in card and "| Q4_K_M |" in card and "context 128, batch 128" in card, card


def _tagged(folder: Path, *names: str) -> dict[str, Path]:
    return {n: next(p for p in folder.glob(f"*-{n}.gguf") if not p.name.startswith("dflash-")) for n in names}


@pytest.mark.reference
def test_quality_of_a_one_pass_folder_makes_its_base(tmp_path: Path) -> None:
    """A folder made in one pass (no 16-bit file anywhere): quality makes the BF16 target from the checkpoint, and
    every number equals llama-perplexity run by hand against b11434's own BF16 conversion; no 16-bit file is left;
    another folder of the same target on the same text makes no base again; another checkpoint is refused."""
    reference.require_or_skip(reference.llama_cpp_available())
    target = mf.make_qwen3_target(tmp_path / "targets", llama_cpp_src=reference.require_llama_cpp_src())
    drafter = mf.make_drafter(tmp_path / "drafters", target="qwen3")
    folder = tmp_path / "pair"
    made = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--quant", "Q4_K_M,Q8_0", "--outdir",
                   folder)
    assert made.returncode == 0, made.stdout + made.stderr
    assert not list(tmp_path.rglob("*BF16*.gguf"))
    text = tmp_path / "text" / "wiki.txt"
    text.parent.mkdir()
    text.write_text(TEXT)
    counting, calls, lib = reference.noting_binary(tmp_path, "llama-perplexity")
    env = {"LLAMA_PERPLEXITY": str(counting), **lib}
    args = ("--text", text, "--chunks", "2", "--threads", "2", "--json")

    no_checkpoint = run_cli("dflash-gguf", "quality", folder, *args, env=env)
    assert no_checkpoint.returncode != 0 and "--checkpoint DIR" in no_checkpoint.stdout + no_checkpoint.stderr
    other_model = mf.make_gemma4_target(tmp_path / "other")
    wrong = run_cli("dflash-gguf", "quality", folder, "--checkpoint", other_model, *args, env=env)
    assert wrong.returncode != 0 and "another model" in wrong.stdout + wrong.stderr

    proc = run_cli("dflash-gguf", "quality", folder, "--checkpoint", target, *args, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert [t["tag"] for t in doc["tags"]] == ["Q4_K_M", "Q8_0"] and doc["base"].endswith("-BF16.gguf")
    assert not list(tmp_path.rglob("*BF16*.gguf")) and not list(folder.rglob("*.kld"))  # nothing 16-bit left
    assert _base_runs(calls) == 1

    bf16 = tmp_path / "ref" / "bf16.gguf"
    bf16.parent.mkdir()
    conv = reference.run_reference_convert(target, None, bf16, "bf16")
    assert conv.returncode == 0, conv.stderr[-3000:]
    logits = tmp_path / "ref" / "base.kld"
    _by_hand(bf16, text, tmp_path / "ref" / "base.log", "--chunks", "2", "--kl-divergence-base", str(logits))
    files = _tagged(folder, "Q4_K_M", "Q8_0")
    for row in doc["tags"]:
        hand = None
        for attempt in range(ATTEMPTS):
            hand = parse_kld(_by_hand(files[row["tag"]], text, tmp_path / "ref" / f"{row['tag']}-{attempt}.log",
                                      "--chunks", "2", "--kl-divergence-base", str(logits), "--kl-divergence"))
            if hand is not None:
                break
        assert hand is not None
        for k, v in hand.to_dict().items():
            assert abs(row[k] - v) <= 1e-4 * max(1.0, abs(v)), (row["tag"], k, row[k], v)
        assert row["size_bytes"] == files[row["tag"]].stat().st_size
    REFERENCE_COMPARISONS.append("quality of a one-pass folder = llama-perplexity against b11434's BF16 by hand")

    other = tmp_path / "other-pair"
    shutil.copytree(folder, other)
    recorded = json.loads((other / "pair.json").read_text())
    del recorded["quality"]
    (other / "pair.json").write_text(json.dumps(recorded))
    again = run_cli("dflash-gguf", "quality", other, "--checkpoint", target, *args, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout)["tags"] == doc["tags"] and _base_runs(calls) == 1  # no base, no logits again
