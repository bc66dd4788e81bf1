"""Real llama-server b11434 serves the multimodal pairs dflash-convert makes: the target with its projector
(``mmproj-``) and the DFlash drafter answer OpenAI chat requests carrying a PNG (and, for Gemma-4's audio towers, a
WAV), the media encoded into more prompt tokens, the drafter drafting and the greedy text unchanged by it. From the
loopback Hub, ``llama-server -hf`` fetches the projector and the sidecar by itself; the ``--models-dir`` router
attaches the projector found beside the target.

The fixtures' weights are random, so the assertions are about what llama.cpp does with the files (encodes the
media, drafts, keeps the greedy text), never about what the model says or how fast. The tower fixtures are sized for
libmtmd's preprocessing (tests/fixtures/gemma.py: each image is resized to at least 70 pooled tokens, and every
patch position must be a row of the position table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fixtures as mf
import hub_server
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli
from test_serve_layout import _server_env

from dflash_gguf.llama_bin import FoundBinary
from dflash_gguf.pipeline.manifest import read_manifest
from dflash_gguf.tune.server import serve as run_llama_server

# pair -> the media its towers take (the Qwen3.5 release has a vision tower only)
PAIRS: dict[str, tuple[str, ...]] = {"gemma4-vision_audio": ("image", "audio"), "gemma4-unified": ("image", "audio"),
                                     "qwen35-vision": ("image",)}
PROMPT = "Describe what you are given."
TOKEN = "hf_projectorServingToken0123456789ab"
REPO = "me/gemma-4-tiny-it-vision_audio-DFlash-GGUF"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Output folders dflash-convert writes for each multimodal fixture pair, side by side under one models folder
    (``--models-dir``'s layout), made on first use."""
    root = tmp_path_factory.mktemp("mm-serving")

    class Pairs(dict):
        def __missing__(self, name: str) -> Path:
            src = root / "src" / name
            if name == "qwen35-vision":
                target = mf.make_qwen35_target(src, llama_cpp_src=reference.require_llama_cpp_src(),
                                               vision_tower=True, name="qwen3.5-tiny-vision")
                drafter = mf.make_drafter(src, target="qwen35")
            else:
                kind = name.removeprefix("gemma4-")
                target = mf.make_gemma4_target(src, name_suffix=f"-{kind}", towers=kind)
                drafter = mf.make_drafter(src, target="gemma4")
            out = root / "models" / target.name
            proc = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            self[name] = out
            return out

    return Pairs()


def _files(folder: Path) -> tuple[Path, Path, Path]:
    """(target, projector, drafter) as the folder's pair.json records them."""
    record = read_manifest(folder / "pair.json")
    assert record.projector is not None, "the run made no projector"
    return record.file("target"), record.folder / record.projector.file, record.drafter_files()[0]


def _prompt_tokens(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens"])


def _said(answer: dict[str, Any]) -> dict[str, Any]:
    """The answer's message (content and any reasoning), what greedy decoding must keep."""
    return dict(answer["choices"][0]["message"])


@pytest.mark.reference
@pytest.mark.parametrize("name", list(PAIRS))
def test_llama_server_answers_media_with_the_projector_and_the_drafter(pairs: dict[str, Path], name: str) -> None:
    """``llama-server -m TARGET --mmproj MMPROJ --model-draft DRAFTER --spec-type draft-dflash``: HTTP 200 for each
    medium, more prompt tokens than the text alone, the drafter drafts, and the greedy text is the target alone's."""
    reference.require_or_skip(reference.llama_cpp_available())
    target, mmproj, drafter = _files(pairs[name])
    requests = {"text": reference.media_chat(PROMPT), **{m: reference.media_chat(PROMPT, m) for m in PAIRS[name]}}
    alone, drafted, log = reference.chat_with_and_without_drafter(target, mmproj, drafter, requests)
    assert f"loaded multimodal model, '{mmproj}'" in log, log[-3000:]
    assert "adding speculative implementation 'draft-dflash'" in log
    for medium in PAIRS[name]:
        assert _prompt_tokens(drafted[medium]) > _prompt_tokens(drafted["text"]), (medium, drafted[medium]["usage"])
        assert _prompt_tokens(alone[medium]) == _prompt_tokens(drafted[medium])
    for kind, answer in drafted.items():
        assert answer["timings"]["draft_n"] > 0, (kind, answer["timings"])
        assert _said(answer) == _said(alone[kind]), kind
    figures = {k: (_prompt_tokens(a), a["timings"]["draft_n"], a["timings"]["draft_n_accepted"])
               for k, a in drafted.items()}
    print(f"{name}: (prompt tokens, draft_n, accepted) {figures}")
    REFERENCE_COMPARISONS.append(f"llama-server --mmproj/{name}")


@pytest.mark.reference
def test_llama_server_hf_fetches_the_projector_and_the_sidecar(pairs: dict[str, Path], tmp_path: Path) -> None:
    """The multimodal pair folder published to the loopback Hub: ``llama-server -hf REPO --spec-type draft-dflash``
    downloads the target, the mmproj- file and the dflash- sidecar, loads the projector by itself (no --mmproj),
    drafts, and answers the image request."""
    reference.require_or_skip(reference.llama_cpp_available())
    folder = pairs["gemma4-vision_audio"]
    target, mmproj, drafter = _files(folder)
    binary = FoundBinary(reference.llama_bin("llama-server"), "test")
    with hub_server.serve({}, valid_tokens=[TOKEN]) as hub:
        env = hub_server.client_env(hub.url, tmp_path / "hf") | {"HF_TOKEN": TOKEN}
        published = run_cli("dflash-gguf", "publish", folder, REPO, "--license", "apache-2.0", env=env)
        assert published.returncode == 0, published.stdout + published.stderr
        assert mmproj.name in hub.repos[REPO].files, sorted(hub.repos[REPO].files)
        hub.requests.clear()
        with run_llama_server(binary, ["-hf", REPO, "--spec-type", "draft-dflash", "-t", "1", "-c", "1024"],
                              startup_timeout=180, env=_server_env(hub, tmp_path / "serve"),
                              workdir=tmp_path) as server:
            status, image = server.request("/v1/chat/completions", reference.media_chat(PROMPT, "image"),
                                           timeout=120)
            _, text = server.request("/v1/chat/completions", reference.media_chat(PROMPT), timeout=120)
        downloads = hub.downloads()
    log = server.log()
    assert status == 200 and isinstance(image, dict), (status, image, log[-3000:])
    assert sorted(set(downloads)) == sorted([target.name, mmproj.name, drafter.name]), downloads
    loaded = [line for line in log.splitlines() if "loaded multimodal model" in line]
    assert len(loaded) == 1 and loaded[0].rstrip().endswith(f"/{mmproj.name}'"), loaded or log[-3000:]
    assert "loading draft model" in log and drafter.name in log
    assert _prompt_tokens(image) > _prompt_tokens(text) and image["timings"]["draft_n"] > 0, image
    print(f"-hf log: {loaded[0].strip()}")
    REFERENCE_COMPARISONS.append("llama-server -hf/mmproj")


@pytest.mark.reference
def test_models_dir_router_attaches_the_projector(pairs: dict[str, Path]) -> None:
    """``llama-server --models-dir PARENT --models-preset FOLDER/models.ini``: the router's scan takes the file whose
    name holds "mmproj" as the folder's projector (common/preset.cpp ``is_mmproj_file``) and the dflash- file as its
    drafter, so the model it starts answers the image request with both."""
    reference.require_or_skip(reference.llama_cpp_available())
    folder = pairs["gemma4-vision_audio"]
    _, mmproj, drafter = _files(folder)
    binary = FoundBinary(reference.llama_bin("llama-server"), "test")
    with run_llama_server(binary, ["--models-dir", str(folder.parent), "--models-preset", str(folder / "models.ini"),
                                   "-t", "1", "-c", "1024"], startup_timeout=180) as router:
        status, image = router.request("/v1/chat/completions",
                                       reference.media_chat(PROMPT, "image", model=folder.name), timeout=300)
        _, text = router.request("/v1/chat/completions", reference.media_chat(PROMPT, model=folder.name),
                                 timeout=300)
        _, listing = router.request("/models", timeout=30)
    assert status == 200 and isinstance(image, dict), (status, image, router.log()[-3000:])
    (model,) = [m for m in listing["data"] if m["id"] == folder.name]
    args = model["status"]["args"]
    assert args[args.index("--mmproj") + 1] == str(mmproj), args
    assert str(drafter) in args, args
    assert _prompt_tokens(image) > _prompt_tokens(text) and image["timings"]["draft_n"] > 0, image
    loaded = [line for line in router.log().splitlines() if "loaded multimodal model" in line]
    print(f"--models-dir args: {args}; log: {loaded}")
    REFERENCE_COMPARISONS.append("llama-server --models-dir/mmproj")
