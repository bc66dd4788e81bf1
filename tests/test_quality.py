"""``dflash-gguf quality``: every tag of a folder against its 16-bit original, by b11434's llama-perplexity.

Asserts the structure (every tag and the base, KLD >= 0, the base against itself 0), that the numbers are the ones
llama-perplexity prints run by hand on the same files and settings, that a second run measures nothing again, and
that the card carries them. Never which tag wins.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import fixtures as mf
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli

from dflash_gguf.tune.quality import ATTEMPTS, parse_kld

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 120
TAGS = ("BF16", "Q4_K_M", "Q8_0")


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
    calls = tmp_path / "calls.txt"
    counting = tmp_path / "llama-perplexity"  # the real binary, each start noted
    counting.write_text(f'#!/bin/sh\necho run >> "{calls}"\nexec "{reference.llama_bin("llama-perplexity")}" "$@"\n')
    counting.chmod(0o755)
    env = {"LLAMA_PERPLEXITY": str(counting), "LD_LIBRARY_PATH": reference._bin_env()["LD_LIBRARY_PATH"]}
    proc = run_cli("dflash-gguf", "quality", folder, "--text", text, "--threads", "2", "--json", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert [t["tag"] for t in doc["tags"]] == ["BF16 (base)", *TAGS]
    assert doc["base"] == "gemma-4-tiny-it-BF16.gguf" and doc["settings"] == {"ctx": 128, "batch": 128,
                                                                              "chunks": None, "threads": 2}
    assert all(t["mean_kld"] >= 0 and t["kld_99"] >= 0 and 0 <= t["same_top_pct"] <= 100 for t in doc["tags"])
    base = doc["tags"][0]
    assert base["mean_kld"] == 0 and base["same_top_pct"] == 100
    # the base's logits, then the base against them (which is also the BF16 tag's result), Q4_K_M and Q8_0 (again
    # when b11434's logger lost the statistics at exit: tune.quality.measure_kld)
    runs = len(calls.read_text().split())
    assert 4 <= runs <= 1 + 3 * ATTEMPTS

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
    assert len(calls.read_text().split()) == runs  # nothing measured again: pair.json's quality answered
    recorded = json.loads((folder / "pair.json").read_text())["quality"]
    assert recorded["text"]["sha256"] == doc["text"]["sha256"] and len(recorded["tags"]) == 4
    card = run_cli("dflash-gguf", "publish", folder, "me/x", "--license", "mit", "--dry-run").stdout
    assert "## Quality" in card and "| Q4_K_M |" in card and "context 128, batch 128" in card, card
