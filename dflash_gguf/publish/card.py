"""The repo's README.md, written from pair.json: what is in the repo, how to run it, how it was made and checked, and
what was measured (with the hardware, flags and workload), or that nothing was."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import __version__
from ..drafters.findings import Report
from ..pipeline.manifest import PairRecord, SourceRecord, Sources, ToolVersions
from ..pipeline.naming import encoding_tag
from ..sidecar import PRESET_NAME
from ..tune import TagSpeed
from ..tune.plot import PLOT_NAME, QUALITY_PLOT_NAME
from .files import UploadFile


def target_on_hub(record: PairRecord) -> SourceRecord | None:
    """The target GGUF given as REPO:FILE from the Hub (someone else's repo), or None."""
    given = record.sources.target_gguf if record.sources is not None else None
    return given if given is not None and given.repo else None


def sources_of(record: PairRecord) -> Iterable[tuple[str, SourceRecord]]:
    """The pair's sources, the target first, each with its side (what the card and the license line name)."""
    sources = record.sources or Sources.from_json(None)
    yield "target", sources.target
    for d in sources.drafters:
        yield "drafter", d


def _hub_command(record: PairRecord, repo_id: str, drafter_only: bool) -> str:
    """The card's ``llama-server`` command: ``-hf`` this repo, or for a drafter-only repo, the target's repo (or
    file) with ``-hfd`` this repo at the drafter's tag."""
    serve = record.serve
    assert serve is not None
    command = serve.hub or ""
    if not drafter_only:
        return command.replace("USER/REPO", repo_id)
    drafter = f"-hfd {repo_id}:{encoding_tag(record.drafter.file)}"
    target = target_on_hub(record)
    where = f"-hf {target.repo}:{encoding_tag(str(target.path))}" if target is not None else f"-m {record.target.file}"
    return command.replace("-hf USER/REPO", f"{where} {drafter}")


def render_card(record: PairRecord, repo_id: str, license: str, files: list[UploadFile], report: Report, *,
                drafter_only: bool = False) -> str:
    """README.md for the repo, from pair.json: what is in it, how to run it, how it was made, how it was checked,
    and what was measured (with the hardware, flags and workload), or that nothing was."""
    sources = list(sources_of(record))
    bases = [s.repo for _, s in sources if s.repo]
    hub_target = target_on_hub(record)
    if hub_target is not None and hub_target.repo not in bases:
        bases.append(str(hub_target.repo))
    kinds = sorted({f.kind for f in files if f.kind})
    tags = ["gguf", "llama.cpp", "speculative-decoding", *kinds]
    head: dict[str, Any] = {"license": license, "library_name": "gguf", "tags": tags}
    if bases:
        head |= {"base_model": bases, "base_model_relation": "quantized"}
    model = record.target.file.removesuffix(".gguf")
    serve = record.serve
    if drafter_only:
        at = (f"[{hub_target.repo}](https://huggingface.co/{hub_target.repo}), file `{hub_target.path}` at commit "
              f"`{hub_target.commit}`" if hub_target is not None else f"`{record.target.file}`")
        lines = ["---", *_yaml(head), "---", "", f"# {record.drafter.file.removesuffix('.gguf')}: a "
                 f"speculative-decoding drafter for {model}", ""]
        lines += [f"A drafter for the target {at}, converted for llama.cpp (b11434 or later) by "
                  f"[dflash-gguf](https://pypi.org/project/dflash-gguf/) {__version__}. This repo holds the drafter "
                  "only: the target is the one named, served from where it is published. The drafter is not a "
                  "standalone model: it only proposes tokens that the target checks, so it is served together with "
                  "that target and no other.", ""]
    else:
        lines = ["---", *_yaml(head), "---", "", f"# {model}: GGUF with its speculative-decoding drafter", ""]
        lines += ["The target model and a drafter for it, converted for llama.cpp (b11434 or later) by "
                  f"[dflash-gguf](https://pypi.org/project/dflash-gguf/) {__version__}. The drafter is not a "
                  "standalone model: it only proposes tokens that the target checks, so it is served together with "
                  "this target and no other.", ""]
    if not report.errors:
        lines += [f"**Verified:** `dflash-verify pair.json` passes ({len(report.results)} checks, "
                  f"{len(report.warnings)} warnings): file format, the pair (vocabulary, hidden size, taps), lineage.",
                  ""]
    else:
        lines += ["**Not verified:** published with `--allow-unverified`; `dflash-verify pair.json` refuses the "
                  "pair:", *(f"- `{r.id}`: {r.message}" for r in report.errors), ""]
    lines += ["## Files", "", "| file | what | type | size | sha256 |", "|---|---|---|---|---|"]
    types = {record.target.file: record.target.type, **{d.file: d.type for d in record.drafters},
             record.drafter.file: record.drafter.type,
             **({record.projector.file: record.projector.type} if record.projector else {}),
             **{rec.file: rec.type for tag in record.tags for rec in (tag.target, tag.drafter)}}
    for f in files:
        lines.append(f"| `{f.path_in_repo}` | {f.role} | {types.get(f.path_in_repo) or ''} | "
                     f"{f.size / 1e6:,.1f} MB | `{f.sha256}` |")
    lines += ["", "## Run it", ""]
    if serve is not None and drafter_only:
        lines += ["```", _hub_command(record, repo_id, True), "```", "",
                  "`-hfd` (`--spec-draft-hf`) fetches the drafter from this repo; the tag picks its file.", "",
                  f"{serve.note}.", ""]
    elif serve is not None:
        text_only = (["", "The projector (`mmproj-`) lets the model take images (and, for Gemma-4, audio); `-hf` "
                      "loads it by itself. For text only, add `--no-mmproj`."] if record.projector else [])
        lines += ["```", _hub_command(record, repo_id, False), "```", *text_only, "", f"{serve.note}.", ""]
        lines += _tags_table(record, repo_id) if record.tags else [
            "Or download the repo into a folder `MODELS/<name>/` and serve llama.cpp's folder layout with the "
            "preset beside it:", "", "```",
            f"llama-server --models-dir MODELS --models-preset MODELS/<name>/{PRESET_NAME}", "```", ""]
    lines += ["## How it was made", ""]
    for side, s in sources:
        where = f"[{s.repo}](https://huggingface.co/{s.repo}) at commit `{s.commit}`" if s.repo \
            else f"a local folder ({Path(str(s.path)).name})"
        lines.append(f"- {side}: {where}")
    tools = record.tools or ToolVersions.from_json({"dflash_gguf": __version__, "llama_cpp_build": "b11434"})
    lines += [f"- made by dflash-gguf {tools.dflash_gguf} (gguf {tools.gguf}), byte for byte what llama.cpp "
              f"{tools.llama_cpp_build}'s convert_hf_to_gguf.py and llama-quantize write; quantizer: {tools.quantizer}",
              f"- target: {', '.join(t.tag for t in record.tags) if record.tags else record.target.type}, "
              f"{record.target.made_by}",
              *([f"- the target's llama-quantize flags, in the order they apply: `{shlex.join(record.quantize_flags)}`"]
                if record.quantize_flags else []),
              *(f"- tag {r.name}: {r.type.upper()} with the rules of `{r.file}`, in the order they apply: "
                f"`{shlex.join(arg for rule in r.rules for arg in ('--tensor-type', rule))}`" for r in record.recipes),
              f"- drafter: {record.drafter.type}, {record.drafter.made_by}"]
    if record.imatrix is not None and not drafter_only:
        lines.append(f"- the target's importance matrix: `{record.imatrix.file}` (sha256 `{record.imatrix.sha256}`), "
                     f"made by {record.imatrix.made_by}")
    lines.append("")
    lines += _measured(record.tuning, serve is not None and serve.measured)
    lines += _tags_measured(record.tag_tuning)
    lines += _quality(record.quality)
    return "\n".join(lines).rstrip() + "\n"


def _tags_table(record: PairRecord, repo_id: str) -> list[str]:
    """The card's tags: each target with the drafter ``-hf REPO:TAG`` serves beside it (``find_best_sibling`` picks
    the sidecar whose name carries ``-TAG.``), and verify's verdict on the two."""
    lines = ["Every tag is a target with its own drafter: `-hf` picks the target by the tag and the drafter whose name "
             "carries the same tag.", "", "| tag | target | drafter | verify | run |", "|---|---|---|---|---|"]
    for tag in record.tags:
        name = encoding_tag(tag.target.file)
        verdict = "passes" if tag.verdict.servable else f"refuses ({tag.verdict.errors} errors)"
        words = (record.serve.hub or "").split(" ") if record.serve else []
        run = " ".join([*words[:2], f"{repo_id}:{name}", *words[3:]]) if len(words) > 2 else ""
        lines.append(f"| {name} | `{tag.target.file}` ({(tag.target.size or 0) / 1e6:,.1f} MB) | `{tag.drafter.file}` "
                     f"({tag.drafter.type}) | {verdict} | `{run}` |")
    lines += ["", "Or download the repo into a folder and serve every tag from it, as the preset beside them names "
              "them:", "", "```", f"llama-server --models-preset {PRESET_NAME}", "```", ""]
    return lines


def _tags_measured(tag_tuning: Any) -> list[str]:
    """``tune --tags``: each tag's speed with its own drafter, side by side, and what it was measured on."""
    speeds = [s for d in (tag_tuning or {}).get("tags") or () if (s := TagSpeed.from_dict(d)) is not None]
    if not speeds:
        return []
    server, workload = tag_tuning.get("server") or {}, tag_tuning.get("workload") or {}
    lines = ["", "### Each tag with its drafter", "",
             "| tag | target alone (tok/s) | fastest | tok/s | speed-up | drafter acceptance |",
             "|---|---|---|---|---|---|"]
    for s in speeds:
        lines.append(f"| {s.tag} | {s.alone_tps or '-'} | {s.best or '-'} | {s.best_tps or '-'} | "
                     f"{f'{s.speedup:.2f}x' if s.speedup else '-'} | "
                     f"{f'{s.acceptance * 100:.1f}%' if s.acceptance is not None else '-'} |")
    fastest = tag_tuning.get("fastest")
    flags = " ".join(tag_tuning.get("user_flags") or ()) or "none"
    lines += ["", (f"Fastest on the machine measured: **{fastest}**. " if fastest else "")
              + f"Measured by `dflash-gguf tune --tags` with llama-server build {server.get('build') or 'unknown'}, "
              f"{server.get('threads') or 'default'} threads, {workload.get('n_predict', '?')} tokens per prompt, "
              f"{workload.get('repeats', '?')} repeat(s); flags: {flags}. Speed depends on the hardware: measure on "
              "yours.", ""]
    return lines


def _quality(quality: Any) -> list[str]:
    """``dflash-gguf quality``: each tag's KL divergence from the 16-bit target, and what it was measured with."""
    rows = [t for t in (quality or {}).get("tags") or () if isinstance(t, dict)]
    if not rows:
        return []
    s, text = quality.get("settings") or {}, quality.get("text") or {}
    lines = ["", "## Quality", "", f"Each tag against the logits of `{quality.get('base')}` (llama-perplexity "
             "`--kl-divergence`):", "",
             "| tag | size (bytes) | bits per weight | mean KLD | 99% KLD | 99.9% KLD | same top token | PPL ratio |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {t.get('tag')} | {t.get('size_bytes')} | {t.get('bits_per_weight')} | {t.get('kld_mean')} | "
              f"{t.get('kld_p99')} | {t.get('kld_p999')} | {t.get('same_top_p')}% | {t.get('ppl_ratio')} |"
              for t in rows]
    lines += ["", f"On `{text.get('name')}` (sha256 `{text.get('sha256')}`), context {s.get('ctx')}, batch "
              f"{s.get('batch')}, {s.get('chunks') or 'all'} chunk(s), {s.get('threads')} threads; "
              f"{quality.get('tool')}; hardware: {quality.get('hardware') or 'not recorded'}."]
    front = [str(t) for t in quality.get("pareto_front") or ()]
    if front:
        lines += ["", f"Least drift for its size (no tag is both smaller and closer): {', '.join(front)}."]
    if quality.get("plot"):
        lines += ["", f"![quality]({QUALITY_PLOT_NAME})"]
    return lines + [""]


def _yaml(data: dict[str, Any]) -> list[str]:
    out = []
    for key, value in data.items():
        if isinstance(value, list):
            out += [f"{key}:", *(f"- {json.dumps(v)}" for v in value)]
        else:
            out.append(f"{key}: {json.dumps(value)}")
    return out


def _measured(tuning: Any, measured: bool) -> list[str]:
    """The tune table with what it was measured with, or the statement that the n-max was not measured."""
    lines = ["## Speed", ""]
    if not measured or not isinstance(tuning, dict) or tuning.get("status") != "measured":
        return lines + ["Not measured: the command above uses the untuned default draft length "
                        "(`--spec-draft-n-max`). `dflash-gguf tune` measures the fastest on your machine; speed-ups "
                        "depend on the hardware.", ""]
    server, workload = tuning.get("server") or {}, tuning.get("workload") or {}
    shape = tuning.get("shape") or {}
    exact = tuning.get("exact_text_check", True)
    check = ("every configuration's text checked against the target alone's" if exact else "text differences from the "
             "target alone's reported: with sampling or several clients the check is not exact")
    lines += [f"Measured by `dflash-gguf tune` with llama-server ({check}):", "",
              f"- served as: {shape.get('sampling') or 'greedy (temperature 0, top_k 1)'}; "
              f"{shape.get('parallel') or 1} client(s) at once"
              + (f"; context {shape['context_per_client']} per client" if shape.get("context_per_client") else ""),
              f"- llama.cpp build: {server.get('build') or '?'}; threads: {server.get('threads') or '?'}; devices: "
              f"{', '.join(server.get('devices') or []) or 'CPU'}",
              f"- system: {server.get('system_info') or '?'}",
              f"- llama-server flags: `{' '.join(tuning.get('user_flags') or []) or '(defaults)'}`",
              f"- workload: {len(workload.get('prompts') or [])} prompts ({', '.join(workload.get('prompts') or [])}), "
              f"{workload.get('n_predict')} tokens each, {workload.get('repeats')} repeats", "",
              "| configuration | tokens/s | speed-up | acceptance |", "|---|---|---|---|"]
    for c in tuning.get("configurations") or []:
        if c.get("status") != "ok":
            continue
        acc = f"{c['acceptance']:.1%}" if isinstance(c.get("acceptance"), float) else ""
        lines.append(f"| {c.get('label')} | {c.get('generation_tokens_per_second')} | "
                     f"{c.get('speedup') or ''} | {acc} |")
    if tuning.get("plot"):
        lines += ["", f"![tune]({PLOT_NAME})"]
    return lines + ["", f"Verdict: {tuning.get('verdict', '')}", ""]
