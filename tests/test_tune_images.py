"""tune with the target's projector: every configuration served with ``--mmproj``, one image prompt measured besides
the text prompts and reported apart (acceptance, tokens/s, the greedy check), the projector found from pair.json or
the output folder by itself.

Offline: the image prompt's request in llama-server's multimodal /completion form, its rendering through the chat
template, the report's separation, the projector found (or left out) by the command. With llama-server b11434: the
Gemma-4 fixture pair with vision and audio towers measured by ``dflash-convert --tune`` and by ``dflash-gguf tune
pair.json``. The fixture's weights are random, so its drafter's acceptance collapses (exit 15); the tests assert that
the image prompt was measured and kept the greedy text, never a speed.
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import fixtures as mf
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli, run_tune

from dflash_gguf.cli.tune import render_report, resolve_projector
from dflash_gguf.drafters import Drafter
from dflash_gguf.errors import ACCEPTANCE_COLLAPSED, TuneError
from dflash_gguf.tune.report import Configuration, Measurement, Sample, ServerInfo, TuneReport
from dflash_gguf.tune.workload import (
    IMAGE_PROMPT,
    MEDIA_MARKER,
    Prompt,
    Workload,
    generated_image,
    render,
)

GGUF = str(Path(sys.executable).parent / "dflash-gguf")
D = Drafter(Path("dflash-t-Q8_0.gguf"), "dflash", "draft-dflash", 16, "Q8_0")


@pytest.fixture(scope="module")
def mm_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder dflash-convert writes for the Gemma-4 fixture with vision and audio towers and its drafter."""
    root = tmp_path_factory.mktemp("tune-images")
    target = mf.make_gemma4_target(root / "src", towers="vision_audio")
    drafter = mf.make_drafter(root / "src", target="gemma4")
    out = root / "pair"
    proc = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


# -- the workload ------------------------------------------------------------------------------------------------

def test_the_generated_image_is_a_square_png() -> None:
    png = generated_image()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (64, 64) and png.endswith(b"IEND\xaeB`\x82")


def test_the_image_prompt_joins_once_and_goes_in_the_multimodal_form() -> None:
    wl = Workload(n_predict=16).with_image_prompt()
    assert [p.name for p in wl.prompts][-1] == IMAGE_PROMPT and wl.with_image_prompt() == wl
    assert [p.kind for p in wl.prompts] == ["text"] * 4 + ["image"]
    assert wl.to_dict()["image"] == {"prompts": ["image"], "source": "generated", "bytes": len(generated_image())}
    own = Workload(image=b"\x89PNG mine", image_source="me.png").with_image_prompt()
    assert own.prompts[-1].image == b"\x89PNG mine" and own.to_dict()["image"]["source"] == "me.png"
    assert Workload().to_dict()["image"] is None

    calls: list[tuple[str, dict[str, Any]]] = []

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        calls.append((path, body))
        if path == "/tokenize":
            return {"tokens": [0] * 10}
        content = body["messages"][-1]["content"]
        text = "".join("<__media_abc__>" if part["type"] == "image_url" else part["text"] for part in content) \
            if isinstance(content, list) else content
        return {"prompt": f"<turn>{text}<turn|>"}

    one = Workload(prompts=(Prompt("chat", ({"role": "user", "content": "hi"},)),), n_predict=16).with_image_prompt()
    rendered = render(post, one, 4096, marker="<__media_abc__>")
    image_call = next(b for p, b in calls if p == "/apply-template" and isinstance(b["messages"][-1]["content"], list))
    first, second = image_call["messages"][-1]["content"]
    assert first["type"] == "image_url" and first["image_url"]["url"].startswith("data:image/png;base64,")
    assert second["type"] == "text"
    assert rendered.kind("image") == "image" and rendered.kind("chat") == "text"
    text = dict(rendered.texts)["image"]
    assert text.count(MEDIA_MARKER) == 1 and "<__media_abc__>" not in text
    body = rendered.request(one, "image", text, marker="<__media_xyz__>")
    assert body["prompt"]["prompt_string"].count("<__media_xyz__>") == 1
    assert body["prompt"]["multimodal_data"] == [base64.b64encode(generated_image()).decode()]
    assert rendered.request(one, "chat", "plain")["prompt"] == "plain"  # text prompts stay strings

    def forgets_the_image(path: str, body: dict[str, Any]) -> dict[str, Any]:
        return {"tokens": []} if path == "/tokenize" else {"prompt": "no image here"}

    with pytest.raises(TuneError, match="without the server's media marker"):
        render(forgets_the_image, one, 4096)


# -- the report ----------------------------------------------------------------------------------------------------

def _samples(drafted: int, accepted: int, image_accepted: int, image_tokens: tuple[int, ...] = (5, 6)) -> tuple:
    return (Sample("chat", 20, 10.0, 16, 100.0, drafted, accepted, (1, 2)),
            Sample("image", 120, 40.0, 16, 200.0, drafted, image_accepted, image_tokens, "image"))


def test_the_report_keeps_text_and_image_prompts_apart() -> None:
    base = Measurement(Configuration(), "ok", _samples(0, 0, 0), 1, None, 1 << 20, 1.0)
    drafting = Measurement(Configuration(D, 3), "ok", _samples(40, 30, 4), 1, 10, 1 << 20, 1.0)
    changed = Measurement(Configuration(D, 7), "ok", _samples(40, 30, 4, (5, 9)), 1, 10, 1 << 20, 1.0)
    report = TuneReport(Path("t.gguf"), (D,), Workload().with_image_prompt(), "off",
                        ServerInfo(Path("llama-server"), "PATH"), (), (base, drafting, changed), None, 3.0,
                        projector=Path("mmproj-t-F16.gguf"))
    assert drafting.of_kind("text").acceptance == 0.75 and drafting.of_kind("image").acceptance == 0.1
    doc = report.to_dict()
    rows = doc["configurations"]
    assert rows[1]["by_prompt_kind"]["text"]["acceptance"] == 0.75
    assert rows[1]["by_prompt_kind"]["image"] == {
        "requests": 1, "generation_tokens_per_second": 80.0, "prompt_tokens_per_second": 3000.0,
        "prompt_tokens": 120.0, "acceptance": 0.1, "draft_tokens": 40, "draft_tokens_accepted": 4}
    assert rows[1]["greedy_by_prompt_kind"]["image"]["same"] is True
    assert rows[2]["greedy_by_prompt_kind"] == {
        "text": {"same": True, "prompt": None, "position": None, "expected": None, "got": None},
        "image": {"same": False, "prompt": "image", "position": 1, "expected": 6, "got": 9}}
    assert doc["projector"] == "mmproj-t-F16.gguf" and "10.0% of its drafts there against 75.0%" in doc["image_prompts"]
    text = render_report(report)
    assert "tok/s text|image" in text and "accept text|image" in text and "75.0%|10.0%" in text
    assert "image prompt: generated image" in text and "A drafter sees the prompt's text tokens only" in text
    plain = TuneReport(Path("t.gguf"), (D,), Workload(), "off", ServerInfo(Path("llama-server"), "PATH"), (),
                       (Measurement(Configuration(), "ok", _samples(0, 0, 0)[:1], 1),), None, 1.0)
    assert "text|image" not in render_report(plain) and plain.to_dict()["image_prompts"] is None


# -- finding the projector ----------------------------------------------------------------------------------------

def test_the_projector_is_found_from_pair_json_and_the_folder(mm_pair: Path, tmp_path: Path) -> None:
    projector = next(mm_pair.glob("mmproj-*.gguf"))
    assert resolve_projector((mm_pair / "pair.json",)) == resolve_projector((mm_pair,)) == projector
    loose = tmp_path / "loose"
    loose.mkdir()
    for f in mm_pair.glob("*.gguf"):
        (loose / f.name).symlink_to(f)
    assert resolve_projector((loose,)) == loose / projector.name  # no pair.json: llama.cpp's "mmproj" name rule
    target = next(p for p in mm_pair.glob("*.gguf") if not p.name.startswith(("dflash-", "mmproj-")))
    assert resolve_projector((target,)) is None

    ran = tmp_path / "ran"
    server = tmp_path / "llama-server"
    server.write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
    server.chmod(0o755)

    def dry(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([GGUF, "tune", *map(str, args), "--dry-run", "--json", "--llama-server", str(server)],
                              capture_output=True, text=True)

    for given in (mm_pair / "pair.json", loose):
        proc = dry(given)
        assert proc.returncode == 0, proc.stderr
        plan = json.loads(proc.stdout)
        assert Path(plan["projector"]).name == projector.name and plan["workload"]["prompts"][-1] == "image"
    plan = json.loads(dry(mm_pair, "--no-mmproj").stdout)
    assert plan["projector"] is None and "image" not in plan["workload"]["prompts"]
    proc = dry(target, "--image", tmp_path / "x.png")
    assert proc.returncode != 0 and "needs the target's projector" in proc.stderr, proc.stderr
    words = subprocess.run([GGUF, "tune", str(mm_pair), "--dry-run", "--llama-server", str(server)],
                           capture_output=True, text=True).stdout
    assert f"--mmproj {projector}" in words and "projector: " in words and not ran.exists()


# -- with llama-server b11434 -----------------------------------------------------------------------------------------

def _image_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in doc["configurations"] if c["status"] == "ok"]


@pytest.mark.reference
def test_tune_measures_the_image_prompt_of_a_multimodal_pair(mm_pair: Path, tmp_path: Path) -> None:
    """``dflash-gguf tune pair.json`` finds the projector there, serves every configuration with it, measures the
    image prompt (more prompt tokens than any text prompt of its size: the image's), its greedy text unchanged by
    the drafter, and reports text and image prompts apart; the random drafter's acceptance collapses (exit 15)."""
    reference.require_or_skip(reference.llama_cpp_available())
    projector = next(mm_pair.glob("mmproj-*.gguf"))
    proc, doc = run_tune(mm_pair / "pair.json", "--n-max", "3", "--repeats", "2", "--n-predict", "16", "--methods",
                         "drafters", "--no-record", "--json", "--", "-t", "1")
    assert proc.returncode == ACCEPTANCE_COLLAPSED, proc.stderr[-3000:]
    assert doc["projector"] == projector.name and doc["workload"]["image"]["source"] == "generated"
    rows = _image_rows(doc)
    assert [r["label"] for r in rows][:2] == ["target alone", "dflash-gemma-4-tiny-it-Q8_0.gguf n-max 3"]
    for row in rows:
        assert set(row["by_prompt_kind"]) == {"text", "image"} and row["by_prompt_kind"]["image"]["requests"] == 2
        assert "--mmproj" not in row["server_args"]  # the target's flag on every configuration, not a method's
    drafted = rows[1]
    image = drafted["by_prompt_kind"]["image"]
    assert image["draft_tokens"] > 0 and image["generation_tokens_per_second"] > 0
    assert drafted["greedy_by_prompt_kind"]["image"]["same"] is True
    assert drafted["greedy_by_prompt_kind"]["text"]["same"] is True
    assert "Image prompt (projector " + projector.name in doc["image_prompts"]
    print(f"tune figures: {json.dumps({r['label']: r['by_prompt_kind'] for r in rows})}")
    REFERENCE_COMPARISONS.append("llama-server tune/image-prompt")


@pytest.mark.reference
def test_the_pipeline_tunes_with_the_projector(tmp_path: Path) -> None:
    """``dflash-convert --tune`` hands the run's projector to tune: pair.json's measurement has the image prompt."""
    reference.require_or_skip(reference.llama_cpp_available())
    target = mf.make_gemma4_target(tmp_path / "src", towers="vision")
    drafter = mf.make_drafter(tmp_path / "src", target="gemma4")
    out = tmp_path / "pair"
    proc = subprocess.run([str(Path(sys.executable).parent / "dflash-convert"), "--target", str(target), "--drafter",
                           str(drafter), "--outdir", str(out), "--tune", "--tune-budget", "5", "--tune-flags", "-t 1",
                           "--tune-methods", "drafters"], capture_output=True, text=True,
                          env=reference.llama_server_env(), stdin=subprocess.DEVNULL, timeout=900)
    assert proc.returncode == ACCEPTANCE_COLLAPSED, proc.stdout + proc.stderr[-3000:]
    tuning = json.loads((out / "pair.json").read_text())["tuning"]
    assert Path(tuning["projector"]).name == "mmproj-gemma-4-tiny-it-F16.gguf"
    assert "image" in tuning["workload"]["prompts"]
    assert all("image" in r["by_prompt_kind"] for r in _image_rows(tuning))
    assert "tok/s text|image" in proc.stdout
    REFERENCE_COMPARISONS.append("llama-server dflash-convert --tune/image-prompt")
