"""A projector (mmproj) GGUF judged against the target it is served with, before llama-server would refuse it.

b11434's mtmd (tools/mtmd/clip.cpp, mtmd.cpp) throws "unknown projector type" for a type it does not know and
"mismatch between text model (n_embd = X) and mmproj (n_embd = Y)" for a projector of another width; a projector
of another architecture's family with the same width loads and feeds the target embeddings it was never trained on,
and a target whose vocabulary lacks the text mtmd wraps media in (``<|image>``, ``<|vision_start|>``...) tokenizes
it into pieces the model never saw around an image. Each gets its own finding here.
"""

from __future__ import annotations

import re

from ..convert.configs import ProjectorType
from ..convert.targets import TARGET_ARCHS, by_gguf
from ..drafters.findings import Report
from ..ggufio.reader import GGUFMeta
from ..provenance import TARGET_REPO, key

# clip-impl.h: KEY_PROJ_TYPE, KEY_VISION_PROJ_TYPE / KEY_AUDIO_PROJ_TYPE, KEY_PROJ_DIM, KEY_HAS_*_ENC
PROJECTOR_TYPE = "clip.projector_type"
MODALITY_TYPE = "clip.{}.projector_type"
PROJECTION_DIM = "clip.{}.projection_dim"
HAS_ENCODER = "clip.has_{}_encoder"
MMPROJ_ARCH = "clip"  # general.architecture of every projector file (gguf-py MODEL_ARCH.MMPROJ)
MODALITIES = ("vision", "audio")
# Every clip.projector_type value b11434 loads (tools/mtmd/clip-impl.h, PROJECTOR_TYPE_NAMES); the suite checks this
# list against the b11434 source.
B11434_PROJECTOR_TYPES = frozenset({
    "mlp", "ldp", "ldpv2", "resampler", "adapter", "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger", "ling3vl",
    "step3vl", "gemma3", "gemma3nv", "gemma3na", "gemma4v", "gemma4a", "gemma4uv", "gemma4ua", "phi4", "idefics3",
    "pixtral", "ultravox", "internvl", "llama4", "qwen2a", "qwen3a", "glma", "qwen2.5o", "voxtral", "meralion",
    "musicflamingo", "lfm2", "kimivl", "paddleocr", "lightonocr", "cogvlm", "janus_pro", "dots_ocr", "dots3note_v",
    "dots3note_a", "deepseekocr", "deepseekocr2", "deepseek4v", "lfm2a", "glm4v", "glm5v", "youtuvl", "yasa2",
    "kimik25", "nemotron_v2_vl", "exaone4_5", "hunyuanvl", "minicpmv4_6", "granite_speech", "mimovl", "minimax_m3",
    "granite4_vision", "mimo_audio", "parakeet", "qwen3tts_spkenc", "qwen3tts_gen", "pockettts_spkenc",
    "pockettts_gen", "muse-glimmer",
})
PICK = "Use the projector published with this target (the mmproj- file of the same repo and size), or make it " \
       "from the target's checkpoint with 'dflash-gguf convert-target TARGET --mmproj'."


def is_projector(meta: GGUFMeta) -> bool:
    """A projector file: general.type mmproj, or the clip architecture (older converters write no type)."""
    return meta.get("general.type") == "mmproj" or meta.arch == MMPROJ_ARCH


def projector_types(meta: GGUFMeta) -> dict[str, str]:
    """modality -> clip projector type: the per-modality key where it is written (a projector of both towers),
    else ``clip.projector_type`` for each encoder the file has."""
    out = {m: t for m in MODALITIES if isinstance(t := meta.get(MODALITY_TYPE.format(m)), str)}
    shared = meta.get(PROJECTOR_TYPE)
    for m in MODALITIES:
        if m not in out and isinstance(shared, str) and meta.get(HAS_ENCODER.format(m)):
            out[m] = shared
    return out


def _known(name: str) -> ProjectorType | None:
    return next((p for arch in TARGET_ARCHS for p in arch.projectors if p.name == name), None)


def check_projector(p: GGUFMeta, t: GGUFMeta) -> Report:
    """projector.*: the projector file ``p`` against the target ``t`` it is served with (``--mmproj``)."""
    r = Report(inputs={"projector": str(p.path), "target": str(t.path)})
    types = projector_types(p)
    if not is_projector(p) or not types:
        r.fail("projector.format", "error", f"{p.path.name} is not a projector: general.type is "
               f"{p.get('general.type')!r}, general.architecture {p.arch!r} and it names no clip projector type.",
               "Pass the mmproj- file made with the target.")
        return r
    r.ok("projector.format", f"projector with {', '.join(f'{m} ({n})' for m, n in types.items())}")
    unknown = sorted(n for n in types.values() if n not in B11434_PROJECTOR_TYPES)
    if unknown:
        r.fail("projector.type", "error", f"{p.path.name}: projector type {', '.join(unknown)} is not one llama.cpp "
               "b11434 loads; llama-server stops with 'unknown projector type'.",
               "Make the projector with a converter of the llama.cpp build you serve with.")
    else:
        r.ok("projector.type", f"projector type {', '.join(sorted(set(types.values())))} known to llama.cpp b11434")
    _check_family(r, p, t, types)
    _check_width(r, p, t, types)
    _check_markers(r, t, types)
    _check_lineage(r, p, t)
    return r


def _check_family(r: Report, p: GGUFMeta, t: GGUFMeta, types: dict[str, str]) -> None:
    """projector.target: the projector type is one the target's architecture has."""
    arch = by_gguf(t.arch)
    if arch is None or not arch.projectors:
        r.skip("projector.target", f"target architecture {t.arch!r}: dflash-gguf knows no projector of its own to "
               "compare with", "warning")
        return
    own = {q.name for q in arch.projectors}
    foreign = sorted(n for n in types.values() if n not in own)
    if foreign:
        r.fail("projector.target", "error", f"{p.path.name} is a {', '.join(foreign)} projector, which is not a "
               f"{t.arch} target's (its projectors are {', '.join(sorted(own))}): it comes from another model "
               "family.", PICK)
    else:
        r.ok("projector.target", f"{', '.join(sorted(set(types.values())))}: a {t.arch} target's projector")


def _embedding_width(t: GGUFMeta) -> int | None:
    """The width mtmd compares against (llama_model_n_embd_inp: n_embd, times 1 + n_deepstack_layers)."""
    n_embd = t.get(f"{t.arch}.embedding_length")
    deepstack = t.get(f"{t.arch}.n_deepstack_layers") or 0
    return int(n_embd) * (1 + int(deepstack)) if isinstance(n_embd, int) else None


def _check_width(r: Report, p: GGUFMeta, t: GGUFMeta, types: dict[str, str]) -> None:
    """projector.width: every tower's output width is the target's embedding width."""
    width = _embedding_width(t)
    dims = {m: p.get(PROJECTION_DIM.format(m)) for m in types}
    if width is None or not all(isinstance(d, int) for d in dims.values()):
        r.skip("projector.width", "the target's embedding_length or the projector's projection_dim is missing",
               "warning")
        return
    wrong = {m: d for m, d in dims.items() if d != width}
    if wrong:
        said = ", ".join(f"{m} {d}" for m, d in wrong.items())
        r.fail("projector.width", "error", f"{p.path.name} projects to {said} but the target's embeddings are "
               f"{width} wide: llama-server b11434 stops with 'mismatch between text model (n_embd = {width}) and "
               f"mmproj (n_embd = {next(iter(wrong.values()))})'. The projector belongs to another model size.", PICK)
    else:
        r.ok("projector.width", f"projects to the target's embedding width ({width})")


def _check_markers(r: Report, t: GGUFMeta, types: dict[str, str]) -> None:
    """projector.markers: the text mtmd wraps media in is in the target's vocabulary as whole tokens."""
    markers = [m for n in types.values() if (known := _known(n)) is not None for m in known.markers]
    tokens = t.get("tokenizer.ggml.tokens")
    if not markers or tokens is None:
        r.skip("projector.markers", "no marker tokens to check" if not markers else "the target has no vocabulary",
               "warning")
        return
    missing = sorted(set(markers) - set(tokens))
    if missing:
        r.fail("projector.markers", "error", f"the target's vocabulary has no token {', '.join(missing)}, which "
               "llama.cpp's mtmd puts around each image or clip: the model would see them as pieces of text it was "
               "never trained on.", PICK)
    else:
        r.ok("projector.markers", f"media markers {', '.join(dict.fromkeys(markers))} are tokens of the target")


def _names(meta: GGUFMeta) -> tuple[str | None, str | None]:
    """(the repo our provenance names, general.name normalised), whichever the file has."""
    repo = meta.get(key(TARGET_REPO))
    name = meta.get("general.name")
    norm = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") if isinstance(name, str) and name else None
    return (repo if isinstance(repo, str) and repo else None), norm


def _check_lineage(r: Report, p: GGUFMeta, t: GGUFMeta) -> None:
    """projector.lineage: both files made from the same checkpoint, where they say so."""
    (p_repo, p_name), (t_repo, t_name) = _names(p), _names(t)
    if p_repo and t_repo:
        same, said = p_repo.lower() == t_repo.lower(), f"made from {p_repo}, the target from {t_repo}"
    elif p_name and t_name:
        same, said = p_name == t_name, f"named {p.get('general.name')!r}, the target {t.get('general.name')!r}"
    else:
        r.skip("projector.lineage", "neither file names the model it was made from", "warning")
        return
    if same:
        r.ok("projector.lineage", f"projector and target from the same model ({p_repo or p.get('general.name')})")
    else:
        r.fail("projector.lineage", "error", f"{p.path.name} was {said}: a projector of another model feeds the "
               "target image embeddings it was not trained with.", PICK)
