"""tune measures every way llama-server speculates for a target, not only our drafter files: the target's own MTP
head (``--spec-type draft-mtp`` with no drafter file), n-gram drafting, each drafter, n-gram drafting before the
fastest drafter; checks that none changes the greedy text; and the pipeline serves whichever wins.

Offline: the methods' flags, the greedy comparison on recorded outputs, device memory from a recorded log, the serve
plan and the folder for each kind of winner. With llama-server b11434: a Qwen3.5 target whose MTP head is built to
predict the target's own next token (``fixtures.acceptance_qwen35``) drafts through draft-mtp at acceptance near 1
and a copy with a perturbed head collapses; the pipeline's folder and command follow the measured winner, whichever
it is on this machine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import click
import fixtures as mf
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, llama_cpp_src, run_cli, run_tune

from dflash_gguf.cli.tune import render_report
from dflash_gguf.drafters import Drafter
from dflash_gguf.errors import ACCEPTANCE_COLLAPSED, InputError, TuneError
from dflash_gguf.ggufio.reader import read_gguf
from dflash_gguf.pipeline.manifest import Manifest, read_manifest
from dflash_gguf.pipeline.naming import DRAFTERS_DIR
from dflash_gguf.pipeline.serve import record_serving
from dflash_gguf.sidecar import sidecars_beside
from dflash_gguf.tune import (
    METHODS,
    TargetInfo,
    TuneOptions,
    applicable_methods,
    first_configurations,
    inspect_drafter,
)
from dflash_gguf.tune.report import (
    Configuration,
    Measurement,
    Sample,
    ServerInfo,
    TuneReport,
    compare_greedy,
    device_memory_from_log,
)
from dflash_gguf.tune.workload import Workload

BIN = Path(sys.executable).parent
D = Drafter(Path("dflash-t-Q8_0.gguf"), "dflash", "draft-dflash", 16, "Q8_0")
TOKENS = (11, 12, 13, 14)


def _m(config: Configuration, tps: float, tokens: tuple[int, ...] = TOKENS, drafted: int = 0,
       accepted: int = 0) -> Measurement:
    """One repeat of one prompt, 64 tokens at ``tps`` tokens/s, generating ``tokens``."""
    return Measurement(config, "ok", (Sample("code", 10, 5.0, 64, 64_000.0 / tps, drafted, accepted, tokens),), 1,
                       None, 100 << 20, 2.0)


def _report(*ms: Measurement, drafters: tuple[Drafter, ...] = (D,), allow: bool = False) -> TuneReport:
    return TuneReport(Path("t.gguf"), drafters, Workload(), "off", ServerInfo(Path("llama-server"), "PATH"), (), ms,
                      None, 10.0, serve_changed_output=allow)


# -- the methods ---------------------------------------------------------------------------------------------------

def test_each_method_is_served_with_the_flags_llama_server_b11434_takes() -> None:
    own = Configuration(n_max=2, own_mtp=True)
    assert own.server_args() == ["--spec-type", "draft-mtp", "--spec-draft-n-max", "2"]  # no -md: its own head
    assert own.method == "draft-mtp (target's own head)" and own.label == "draft-mtp (target's own head) n-max 2"
    mod = Configuration(ngram="ngram-mod")
    assert mod.server_args() == ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "24",  # --spec-default's
                                 "--spec-ngram-mod-n-min", "48", "--spec-ngram-mod-n-max", "64"]
    assert Configuration(ngram="ngram-simple").server_args() == ["--spec-type", "ngram-simple"]
    both = Configuration(D, 4, ngram="ngram-mod")
    assert both.server_args()[:4] == ["--model-draft", "dflash-t-Q8_0.gguf", "--spec-type", "ngram-mod,draft-dflash"]
    assert both.method == "ngram-mod + draft-dflash" and both.label == "ngram-mod + dflash-t-Q8_0.gguf n-max 4"
    assert Configuration().alone and Configuration().server_args() == [] and not own.alone


def test_the_candidates_follow_the_target_and_the_methods_asked_for() -> None:
    with_head, without = TargetInfo(Path("t.gguf"), "qwen35", 1), TargetInfo(Path("t.gguf"), "gemma4", 0)
    everything = TuneOptions(n_max_values=(2,))
    assert applicable_methods(with_head, [], everything) == ("mtp", "ngram-mod", "ngram-simple")
    assert applicable_methods(without, [D], everything) == ("ngram-mod", "ngram-simple", "drafters", "ngram+drafter")
    labels = [c.label for c in first_configurations(with_head, [D], everything)]
    assert labels == ["target alone", "draft-mtp (target's own head) n-max 2", "ngram-mod", "ngram-simple",
                      "dflash-t-Q8_0.gguf n-max 2"]
    assert applicable_methods(without, [D], TuneOptions(methods=frozenset({"mtp"}))) == ()


def test_a_target_without_its_own_head_and_no_drafter_has_nothing_to_compare(demo_pair: Path) -> None:
    from dflash_gguf.tune import plan_tune

    target = read_manifest(demo_pair / "pair.json").file("target")
    with pytest.raises(TuneError, match="--methods mtp names no method that applies") as e:
        plan_tune(target, [], TuneOptions(methods=frozenset({"mtp"})))
    assert "its own MTP head: none" in str(e.value)
    alone = run_cli("dflash-gguf", "tune", target, "--dry-run", "--llama-server", sys.executable)
    assert alone.returncode == 0, alone.stderr
    assert "methods: target alone, ngram-mod, ngram-simple" in alone.stdout and "its own MTP head: none" in alone.stdout


def test_methods_are_parsed_and_a_wrong_name_is_refused() -> None:
    from dflash_gguf.cli.tune import parse_methods

    assert parse_methods(()) == frozenset(METHODS)
    assert parse_methods(("mtp,ngram-mod", "drafters")) == {"mtp", "ngram-mod", "drafters"}
    with pytest.raises(click.BadParameter, match="eagle: not a method"):
        parse_methods(("eagle",))


# -- the greedy check ---------------------------------------------------------------------------------------------

def test_the_greedy_check_names_the_first_differing_token() -> None:
    ref = (Sample("code", 1, 1.0, 4, 1.0, tokens=(5, 6, 7, 8)), Sample("chat", 1, 1.0, 3, 1.0, tokens=(1, 2, 3)))
    same = compare_greedy(ref, (Sample("chat", 1, 1.0, 3, 1.0, tokens=(1, 2, 3)),))
    assert same.same is True and same.text == "same"
    differs = compare_greedy(ref, (Sample("code", 1, 1.0, 4, 1.0, tokens=(5, 6, 9, 8)),))
    assert (differs.same, differs.prompt, differs.position, differs.expected, differs.got) == (False, "code", 2, 7, 9)
    assert differs.text == "differs at token 2 of 'code'"
    shorter = compare_greedy(ref, (Sample("chat", 1, 1.0, 2, 1.0, tokens=(1, 2)),))
    assert (shorter.same, shorter.position, shorter.expected, shorter.got) == (False, 2, 3, None)
    assert compare_greedy(ref, (Sample("chat", 1, 1.0, 3, 1.0),)).same is None  # no tokens: nothing compared


def test_a_configuration_that_changes_the_text_is_reported_and_not_served_unless_asked() -> None:
    base, good = _m(Configuration(), 10.0), _m(Configuration(D, 3), 14.0, drafted=60, accepted=50)
    broken = _m(Configuration(D, 7), 20.0, tokens=(11, 12, 99, 14), drafted=60, accepted=55)
    r = _report(base, good, broken)
    assert r.changed_output == (broken,) and r.best is good and r.best_for(D) is good
    assert "changed the greedy text (token 2 of 'code': 99 where the target alone gives 13)" in r.verdict
    assert "not served" in r.verdict
    rows = r.to_dict()["configurations"]
    assert [c["changed_output"] for c in rows] == [False, False, True] and rows[2]["servable"] is False
    assert rows[2]["greedy_same_as_target"]["position"] == 2
    asked = _report(base, good, broken, allow=True)
    assert asked.best is broken and "served anyway, as asked" in asked.verdict


def test_the_own_head_collapsing_is_a_collapse() -> None:
    r = _report(_m(Configuration(), 10.0), _m(Configuration(n_max=2, own_mtp=True), 5.0, drafted=400, accepted=0),
                drafters=())
    assert r.own_mtp_collapsed and r.collapse_found and r.collapsed == ()
    assert r.verdict.startswith("Acceptance collapsed for the target's own MTP head")


# -- memory -------------------------------------------------------------------------------------------------------

# llama.cpp b11434's load-time buffer lines (llama_model::load_tensors, llama_kv_cache, llama_context) as a CUDA
# build prints them at -lv 4, target and drafter contexts alike; the host buffers must not count.
CUDA_LOG = """\
0.01.259.093 I load_tensors:   CPU_Mapped model buffer size =   402.00 MiB
0.01.259.100 I load_tensors:        CUDA0 model buffer size =   620.50 MiB
0.01.262.887 I llama_context:  CUDA_Host  output buffer size =     0.58 MiB
0.01.262.922 I llama_kv_cache:      CUDA0 KV buffer size =   128.00 MiB
0.01.270.947 I sched_reserve:      CUDA0 compute buffer size =   100.25 MiB
0.01.270.950 I sched_reserve:  CUDA_Host compute buffer size =    12.01 MiB
0.01.280.561 I load_tensors:        CUDA1 model buffer size =    48.25 MiB
"""
CPU_LOG = """\
0.01.259.093 I load_tensors:   CPU_Mapped model buffer size =    20.09 MiB
0.01.262.922 I llama_kv_cache:        CPU KV buffer size =     0.25 MiB
0.01.263.011 I llama_memory_recurrent:        CPU RS buffer size =     0.89 MiB
0.01.270.947 I sched_reserve:        CPU compute buffer size =    10.42 MiB
"""


def test_device_memory_is_reported_when_the_model_is_offloaded() -> None:
    devices = device_memory_from_log(CUDA_LOG)
    assert [(d.name, d.mib) for d in devices] == [("CUDA0", 848.75), ("CUDA1", 48.25)]
    offloaded = Measurement(Configuration(), "ok", peak_rss=546_000_000, device_memory=devices)
    assert offloaded.memory_text == "849 MiB CUDA0 + 48 MiB CUDA1"  # not the host's 546 MB
    assert offloaded.offloaded_bytes == round(897.0 * 1024 * 1024)
    assert offloaded.to_dict()["device_memory_mib"] == {"CUDA0": 848.75, "CUDA1": 48.25}
    host = Measurement(Configuration(), "ok", peak_rss=546_000_000, device_memory=device_memory_from_log(CPU_LOG))
    assert host.device_memory == () and host.memory_text == "546 MB RSS"


# -- serving the winner -------------------------------------------------------------------------------------------

def _winning(drafter: Drafter, winner: Configuration) -> TuneReport:
    """Every kind of configuration measured; ``winner`` (by label: the drafter may have moved since) fastest."""
    configs = [Configuration(), Configuration(n_max=2, own_mtp=True), Configuration(ngram="ngram-mod"),
               Configuration(drafter, 3), Configuration(drafter, 3, ngram="ngram-mod")]
    ms = [_m(c, 30.0 if c.label == winner.label else 10.0 + i, drafted=60 if i else 0, accepted=50 if i else 0)
          for i, c in enumerate(configs)]
    return _report(*ms, drafters=(drafter,))


def test_the_folder_and_the_command_follow_the_winner(demo_pair: Path, tmp_path: Path) -> None:
    """Own MTP head, n-gram, drafter behind n-gram, target alone: pair.json, models.ini, the printed command and the
    file beside the target each say what is served; the drafter waits in drafters/ while it is not."""
    folder = Path(shutil.copytree(demo_pair, tmp_path / "gemma-4-tiny-it"))
    record = read_manifest(folder / "pair.json")
    target, drafter_file = record.file("target"), record.file("drafter")
    drafter = inspect_drafter(drafter_file)
    name = drafter_file.name
    cases = [
        (Configuration(n_max=2, own_mtp=True), ["--spec-type", "draft-mtp", "--spec-draft-n-max", "2"], False),
        (Configuration(ngram="ngram-mod"), ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "24",
                                            "--spec-ngram-mod-n-min", "48", "--spec-ngram-mod-n-max", "64"], False),
        (Configuration(drafter, 3, ngram="ngram-mod"), ["--model-draft", name, "--spec-type",
                                                        "ngram-mod,draft-dflash", "--spec-ngram-mod-n-match", "24",
                                                        "--spec-ngram-mod-n-min", "48", "--spec-ngram-mod-n-max",
                                                        "64", "--spec-draft-n-max", "3"], True),
        (Configuration(), [], False),
        (Configuration(drafter, 3), ["--model-draft", name, "--spec-type", "draft-dflash",
                                     "--spec-draft-n-max", "3"], True),
    ]
    for winner, args, beside in cases:
        manifest = Manifest.load(folder)
        now = folder / read_manifest(folder / "pair.json").drafter.file
        record_serving(manifest, target, now, _winning(replace_path(drafter, now), winner))
        doc = json.loads((folder / "pair.json").read_text())
        serve = doc["serve"]
        assert serve["command"] == ["llama-server", "-m", target.name, *args], winner.label
        assert serve["method"] == winner.method and serve["uses_drafter"] is beside
        assert [p.name for p in sidecars_beside(target)] == ([name] if beside else []), winner.label
        expected_file = name if beside else f"{DRAFTERS_DIR}/{name}"
        assert doc["outputs"]["drafter"]["file"] == expected_file and (folder / expected_file).is_file()
        assert "--spec-draft-n-max 3" in serve["with_drafter"]  # the drafter's own best, whatever won
        preset = (folder / "models.ini").read_text()
        inferred = ("--model-draft", "--spec-type") if winner.drafter and not winner.ngram else ("--model-draft",)
        for key, value in zip(args[::2], args[1::2], strict=True):
            if key not in inferred:  # the router attaches the sidecar beside the target and reads its kind
                assert f"{key.lstrip('-')} = {value}" in preset, (winner.label, preset)
        if not args:
            assert "spec-" not in preset.split("]", 1)[1]
        verified = run_cli("dflash-verify", str(folder / "pair.json"))
        assert verified.returncode == 0, verified.stdout + verified.stderr  # the record names where the file is


def test_a_drafter_set_aside_by_tune_is_reused_by_the_next_run(tmp_path: Path) -> None:
    """After another method won, the drafter waits in drafters/; running the pipeline again puts it back beside the
    target, where its stage record has it, and reuses it rather than converting it again."""
    target = mf.make_gemma4_target(tmp_path / "targets")
    drafter_dir = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    folder = tmp_path / "pair"
    assert run_cli("dflash-convert", "--target", target, "--drafter", drafter_dir, "--outdir", folder).returncode == 0
    record = read_manifest(folder / "pair.json")
    drafter = record.file("drafter")
    record_serving(Manifest.load(folder), record.file("target"), drafter,
                   _winning(inspect_drafter(drafter), Configuration(ngram="ngram-mod")))
    parked = folder / DRAFTERS_DIR / drafter.name
    assert parked.is_file() and not drafter.exists()
    inode = parked.stat().st_ino
    again = run_cli("dflash-convert", "--target", target, "--drafter", drafter_dir, "--outdir", folder)
    assert again.returncode == 0, again.stdout + again.stderr
    assert drafter.stat().st_ino == inode and not (folder / DRAFTERS_DIR).exists()  # the same file, not made again
    assert read_manifest(folder / "pair.json").drafter.file == drafter.name


def replace_path(d: Drafter, path: Path) -> Drafter:
    from dataclasses import replace

    return replace(d, path=path)


# -- with real llama-server b11434 ---------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The constructed Qwen3.5 pair as HF folders and as GGUFs by the built-in converters (Q8_0)."""
    reference.require_or_skip(reference.llama_cpp_available())
    from dflash_gguf.convert.targets import convert_target

    root = tmp_path_factory.mktemp("qwen35-acceptance")
    fx = mf.make_qwen35_acceptance_fixture(root / "hf", llama_cpp_src=llama_cpp_src())
    out = {"target_dir": fx.target, "drafter_dir": fx.drafter, "target": root / "qwen3.5-tiny-Q8_0.gguf",
           "perturbed": root / "perturbed" / "qwen3.5-tiny-Q8_0.gguf"}
    out["perturbed"].parent.mkdir()
    convert_target(fx.target, out["target"], quant="q8_0")
    convert_target(fx.perturbed_head_target, out["perturbed"], quant="q8_0")
    return out




@pytest.mark.reference
def test_the_targets_own_mtp_head_drafts_with_no_drafter_file(qwen35: dict[str, Path]) -> None:
    """tune TARGET.gguf alone: its MTP head through draft-mtp (no -md) accepts ~every draft, n-gram drafting is
    measured beside it, and no configuration changes the greedy text."""
    meta = read_gguf(qwen35["target"])
    assert meta.get("qwen35.nextn_predict_layers") == 1 and "blk.4.nextn.eh_proj.weight" in meta.tensors
    proc, doc = run_tune(qwen35["target"], "--quick", "--n-max", "2", "--n-predict", "32", "--json", "--", "-t", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = doc["configurations"]
    assert [r["method"] for r in rows] == ["target alone", "draft-mtp (target's own head)", "ngram-mod",
                                           "ngram-simple", "target alone"]
    assert all(r["status"] == "ok" for r in rows), rows
    head = rows[1]
    assert head["server_args"] == ["--spec-type", "draft-mtp", "--spec-draft-n-max", "2"]
    assert 0.8 < head["acceptance"] <= 1.0 and head["draft_tokens"] > 0, head
    assert all(r["greedy_same_as_target"]["same"] is True for r in rows[1:]), rows
    assert doc["own_mtp_collapsed"] is False and doc["exit_code"] == 0
    assert {r["method"] for r in doc["ranking"]} == {"target alone", "draft-mtp (target's own head)", "ngram-mod",
                                                     "ngram-simple"}
    REFERENCE_COMPARISONS.append("llama-server/tune-own-mtp-head")


@pytest.mark.reference
def test_a_perturbed_mtp_head_collapses_with_the_collapse_exit_code(qwen35: dict[str, Path]) -> None:
    proc, doc = run_tune(qwen35["perturbed"], "--methods", "mtp", "--n-max", "2", "--n-predict", "32", "--repeats", "1",
                      "--json", "--", "-t", "1")
    assert proc.returncode == ACCEPTANCE_COLLAPSED, proc.stderr[-3000:]
    head = [r for r in doc["configurations"] if r["method"] == "draft-mtp (target's own head)"]
    assert head and all(r["acceptance"] < 0.05 and r["draft_tokens"] >= 32 for r in head), head
    assert doc["own_mtp_collapsed"] is True and doc["verdict"].startswith("Acceptance collapsed for the target's own")
    REFERENCE_COMPARISONS.append("llama-server/tune-own-mtp-collapse")


@pytest.mark.reference
def test_the_pipeline_serves_whichever_method_is_fastest(qwen35: dict[str, Path], tmp_path: Path) -> None:
    """dflash-convert --tune on a Qwen3.5 target and a DFlash drafter ranks the target alone, its own MTP head,
    n-gram drafting and the drafter in one table; pair.json, models.ini, the folder and llama-server's router all
    follow the measured winner, whichever it is on this machine."""
    models = tmp_path / "models"
    outdir = models / "qwen3.5-tiny"
    proc = subprocess.run([str(BIN / "dflash-convert"), "--target", str(qwen35["target_dir"]), "--drafter",
                           str(qwen35["drafter_dir"]), "--outdir", str(outdir), "--quant", "q8_0", "--tune",
                           # --no-mmproj: the fixture keeps a few of the release's vision tensors, no whole tower
                           "--tune-budget", "10", "--tune-flags", "-t 1", "--no-mmproj"],
                          capture_output=True, text=True,
                          env=reference.llama_server_env(), stdin=subprocess.DEVNULL, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((outdir / "pair.json").read_text())
    tuning, serve = doc["tuning"], doc["serve"]
    methods = {r["method"] for r in tuning["ranking"]}
    assert {"target alone", "draft-mtp (target's own head)", "ngram-mod", "draft-dflash"} <= methods, methods
    assert all(c["greedy_same_as_target"]["same"] is not False for c in tuning["configurations"])
    best = tuning["best"]
    target = outdir / doc["outputs"]["target"]["file"]
    assert serve["method"] == best["method"] and serve["measured"] is True
    assert serve["command"] == ["llama-server", "-m", target.name, *best["server_args"]], (serve, best)
    uses_drafter = best["drafter"] is not None
    beside = [p.name for p in sidecars_beside(target)]
    assert serve["uses_drafter"] is uses_drafter and (beside != []) is uses_drafter, (beside, best)
    assert (outdir / doc["outputs"]["drafter"]["file"]).is_file()
    assert run_cli("dflash-verify", str(outdir / "pair.json")).returncode == 0

    from dflash_gguf.llama_bin import FoundBinary
    from dflash_gguf.tune.server import serve as run_server

    binary = FoundBinary(reference.llama_bin("llama-server"), "test")
    with run_server(binary, ["--models-dir", str(models), "--models-preset", str(outdir / "models.ini"), "-t", "1",
                             "-c", "1024"]) as router:
        answer = router.post("/completion", {"model": "qwen3.5-tiny", "prompt": "hello hello hello hello",
                                             "n_predict": 16, "temperature": 0}, timeout=300)
        _, listing = router.request("/models", timeout=30)
    (model,) = listing["data"]
    args = model["status"]["args"]
    spec = best["spec_type"]
    assert (args[args.index("--spec-type") + 1] == spec) if spec else "--spec-type" not in args, (args, best)
    assert any(a.endswith(".gguf") and "dflash-" in a for a in args) is uses_drafter, args
    assert answer["timings"]["predicted_n"] == 16
    if spec and "draft-" in spec:  # a model drafts on any text (n-gram drafting may find nothing in 16 tokens)
        assert answer["timings"]["draft_n"] > 0, answer["timings"]
    REFERENCE_COMPARISONS.append("llama-server/pipeline-serves-the-winning-method")


def test_no_mtp_leaves_the_head_out_and_tune_then_offers_none(qwen35: dict[str, Path], tmp_path: Path) -> None:
    outdir = tmp_path / "no-mtp"
    run = run_cli("dflash-convert", "--target", qwen35["target_dir"], "--drafter", qwen35["drafter_dir"], "--outdir",
                  # --no-mmproj: the fixture keeps a few of the release's vision tensors, no whole tower
                  outdir, "--quant", "q8_0", "--no-mtp", "--no-mmproj")
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads((outdir / "pair.json").read_text())
    assert doc["options"]["drop_mtp"] is True
    meta = read_gguf(outdir / doc["outputs"]["target"]["file"])
    assert meta.get("qwen35.nextn_predict_layers") is None and not [t for t in meta.tensors if ".nextn." in t]
    plan = run_cli("dflash-gguf", "tune", outdir, "--dry-run", "--json", "--llama-server",
                   reference.llama_bin("llama-server"))
    assert plan.returncode == 0, plan.stderr
    assert "mtp" not in json.loads(plan.stdout)["methods"]
    refused = run_cli("dflash-convert", "--target", qwen35["target_dir"], "--drafter", qwen35["drafter_dir"],
                      "--outdir", tmp_path / "x", "--no-mtp", "--target-gguf", qwen35["target"])
    assert refused.returncode == 2 and "--no-mtp applies to a target this run converts" in refused.stderr


# -- the curve ----------------------------------------------------------------------------------------------------

def _drafting(n_max: int, tps: float, steps: int, accepted: int) -> Measurement:
    """A drafter configuration measured with ``steps`` verification steps that kept ``accepted`` drafted tokens."""
    return replace(_m(Configuration(D, n_max), tps, drafted=steps * n_max, accepted=accepted), draft_steps=steps)


def test_each_measured_configuration_is_placed_on_its_curve() -> None:
    """At a fixed n-max a step costs the same whatever is kept, so a configuration at L tokens per step and S tokens/s
    breaks even at L * base / S and would draw level with the fastest of its sweep at L * fastest / S."""
    four, fifteen = _drafting(4, 140.0, 100, 238), _drafting(15, 90.0, 100, 164)  # L 3.38 and 2.64
    report = _report(_m(Configuration(), 100.0), four, fifteen)
    by_n = {p.n_max: p for p in report.placements}
    assert by_n[4].accepted_length == pytest.approx(3.38) and by_n[4].speedup == pytest.approx(1.4)
    assert by_n[4].break_even_length == pytest.approx(3.38 / 1.4)
    assert by_n[4].fastest_of_sweep is None and by_n[4].length_to_win is None
    assert by_n[15].break_even_length == pytest.approx(2.64 / 0.9)  # not reached: slower than the target alone
    assert by_n[15].length_to_win == pytest.approx(2.64 * 140 / 90) and by_n[15].fastest_of_sweep == four.config.label
    assert "would need L 4.11 to draw level with" in by_n[15].sentence and "(reached)" not in by_n[15].sentence
    assert "(reached)" in by_n[4].sentence
    doc = report.to_dict()["placements"]
    assert {p["n_max"]: p["acceptance_length_to_win"] for p in doc} == {4: None, 15: 4.107}
    text = render_report(report)
    assert "on the curve" in text and by_n[15].sentence in text



# -- sampling -----------------------------------------------------------------------------------------------------

def test_the_requests_sample_as_given_and_seeded() -> None:
    from dflash_gguf.tune.workload import Sampling

    assert Workload().request("p")["temperature"] == 0.0 and Workload().request("p")["top_k"] == 1
    hot = Workload(sampling=Sampling(0.8, top_p=0.9, seed=3, source="given")).request("p")
    assert (hot["temperature"], hot["top_p"], hot["seed"]) == (0.8, 0.9, 3) and "top_k" not in hot  # server default
    model = Sampling.of_model({"general.sampling.temp": 0.6, "general.sampling.top_k": 20}, top_p=0.95)
    assert (model.temperature, model.top_k, model.top_p) == (0.6, 20, 0.95) and "generation_config" in model.source
    with pytest.raises(InputError, match="no general.sampling.temp"):
        Sampling.of_model({})
    probabilistic = Configuration(D, 4, draft_sampling="probabilistic")
    assert probabilistic.server_args()[-2:] == ["--spec-draft-sampling", "probabilistic"]
    assert probabilistic.label == "dflash-t-Q8_0.gguf n-max 4 probabilistic draft"


def test_when_sampling_other_text_under_the_same_seed_is_reported_not_ruled_out() -> None:
    from dflash_gguf.tune.workload import Sampling

    other = _m(Configuration(D, 4), 150.0, tokens=(11, 12, 99, 14))
    greedy = _report(_m(Configuration(), 100.0), other)
    assert not greedy.servable(other) and greedy.changed_output == (other,)
    sampled = replace(greedy, workload=Workload(sampling=Sampling(0.8, source="given")))
    assert sampled.servable(other) and sampled.changed_output == () and sampled.text_apart == (other,)
    assert sampled.best is other and "Under the same seeds and prompts 1 configuration(s)" in sampled.verdict
    assert "Sampled (temperature 0.8" in sampled.verdict
    assert "same-seed text" in render_report(sampled) and "temperature 0.8" in render_report(sampled)


def test_sampling_flags_meant_for_the_server_are_refused(demo_pair: Path) -> None:
    target = read_manifest(demo_pair / "pair.json").file("target")
    server = run_cli("dflash-gguf", "tune", target, "--dry-run", "--llama-server", sys.executable, "--", "--temp",
                     "0.8")
    assert server.returncode == 2 and "--temperature" in server.stdout + server.stderr
    filters = run_cli("dflash-gguf", "tune", target, "--dry-run", "--llama-server", sys.executable, "--top-p", "0.9")
    assert filters.returncode == 2 and "add --temperature" in filters.stdout + filters.stderr
    hot = run_cli("dflash-gguf", "tune", target, "--dry-run", "--llama-server", sys.executable, "--temperature", "0.7")
    assert hot.returncode == 0 and "temperature 0.7, seed 0 (given)" in hot.stdout
    assert "--spec-draft-sampling probabilistic" in hot.stdout


# -- several clients ----------------------------------------------------------------------------------------------

def test_several_clients_are_ranked_by_their_aggregate_and_shown_per_client_and_slot() -> None:
    """Two clients, one repeat: each request's own timings give a client's speed; every token of the round over its
    wall time is the aggregate the configurations are ranked by; each slot's acceptance comes from its requests."""
    from dflash_gguf.tune.engine import with_default_flags

    def sample(slot: int, client: int, accepted: int) -> Sample:
        return Sample("code", 10, 5.0, 64, 1000.0, 40, accepted, TOKENS, slot=slot, client=client)

    m = Measurement(Configuration(D, 4), "ok", (sample(0, 0, 30), sample(1, 1, 10)), 1, None, 1 << 20, 3.0,
                    parallel=2, round_seconds=(1.25,))
    assert m.client_tps == pytest.approx(64.0) and m.gen_tps == pytest.approx(128 / 1.25)
    assert m.acceptance_per_slot == {0: 0.75, 1: 0.25}
    doc = m.to_dict()
    assert doc["parallel"] == 2 and [(x["slot"], x["acceptance"]) for x in doc["slots"]] == [(0, 0.75), (1, 0.25)]
    assert doc["aggregate_generation_tokens_per_second"] == 102.4
    assert doc["per_client_generation_tokens_per_second"] == 64.0 and doc["draft_sampling"] == "greedy"
    base = Measurement(Configuration(), "ok", (sample(0, 0, 0), sample(1, 1, 0)), 1, None, 1 << 20, 3.0, parallel=2,
                       round_seconds=(1.0,))
    report = _report(base, m)
    assert report.parallel == 2 and not report.exact_text_check and report.placements == ()
    text = render_report(report)
    assert "client tok/s" in text and "75.0|25.0" in text and "2 clients at once (-np 2)" in text
    assert with_default_flags(["-t", "2"], 4) == ["-t", "2", "-c", "16384", "-np", "4", "-lv", "4", "--metrics"]
    assert with_default_flags(["-c", "8192"], 4)[:4] == ["-c", "8192", "-np", "4"]  # the user's context is kept


def test_the_winner_for_several_clients_is_served_with_as_many_slots(demo_pair: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(demo_pair, tmp_path / "gemma-4-tiny-it"))
    record = read_manifest(folder / "pair.json")
    drafter = inspect_drafter(record.file("drafter"))
    report = _winning(drafter, Configuration(drafter, 3))
    four = replace(report, measurements=tuple(replace(m, parallel=4) for m in report.measurements),
                   user_flags=("-t", "2", "-ngld", "99", "--cache-type-k=q8_0", "-devd", "CUDA1"), context=65536)
    record_serving(Manifest.load(folder), record.file("target"), record.file("drafter"), four)
    serve = read_manifest(folder / "pair.json").serve
    assert serve is not None and serve.shell.endswith("-np 4 -ngld 99 --cache-type-k=q8_0 -devd CUDA1 -c 65536")
    assert "parallel = 4" in (folder / "models.ini").read_text() and "-t 2" not in serve.shell
    np_flag = run_cli("dflash-gguf", "tune", folder, "--dry-run", "--llama-server", sys.executable, "--", "-np", "4")
    assert np_flag.returncode == 2 and "--parallel N" in np_flag.stdout + np_flag.stderr
    planned = run_cli("dflash-gguf", "tune", folder, "--dry-run", "--llama-server", sys.executable, "--parallel", "4")
    assert planned.returncode == 0 and "-c 16384 -np 4" in planned.stdout


def test_a_shape_changes_the_clients_the_context_and_the_sampling() -> None:
    from dflash_gguf.cli.tune import shape_options
    from dflash_gguf.tune.workload import Sampling

    base = TuneOptions(workload=Workload(sampling=Sampling(0.6, top_p=0.9, seed=5, source="given")))
    four = shape_options("np=4,ctx=16384,temp=0.8", base)
    assert (four.parallel, four.ctx, four.workload.sampling.temperature) == (4, 16384, 0.8)
    assert four.workload.sampling.top_p == 0.9 and four.workload.sampling.seed == 5  # the rest kept
    assert shape_options("temp=0", base).workload.sampling.greedy and shape_options("", base) == base
    with pytest.raises(click.BadParameter, match="KEY one of np, ctx, temp"):
        shape_options("threads=4", base)
    with pytest.raises(click.BadParameter, match="not a number"):
        shape_options("np=four", base)


def test_the_buffers_are_split_between_the_target_the_drafter_and_the_projector() -> None:
    """In b11434's order: the target's model and context, then the draft model and its context, then the projector
    (clip); the line formats of llama_model::load_tensors, llama_kv_cache and llama_context."""
    from dflash_gguf.tune.memory import MemorySplit, kv_cache_mib, parse_size

    log = "\n".join([
        "load_tensors:   CPU_Mapped model buffer size =   120.00 MiB",
        "llama_context: constructing llama_context",
        "llama_context:        CPU  output buffer size =     0.58 MiB",
        "llama_kv_cache:        CPU KV buffer size =    64.00 MiB",
        "llama_context:        CPU compute buffer size =   300.75 MiB",
        "load_tensors:   CPU_Mapped model buffer size =    10.00 MiB",
        "llama_context: constructing llama_context",
        "llama_kv_cache:      CUDA0 KV buffer size =     8.00 MiB",
        "llama_context:      CUDA0 compute buffer size =    20.00 MiB",
        "clip_model_loader:      CPU model buffer size =     5.00 MiB"])
    split = MemorySplit.from_log(log).to_dict()
    assert split["target"] == {"model": 120.0, "kv": 64.0, "compute": 300.75, "other": 0.58, "total": 485.33}
    assert split["drafter"] == {"model": 10.0, "kv": 8.0, "compute": 20.0, "other": 0.0, "total": 38.0}
    assert split["projector"]["model"] == 5.0
    own_head = MemorySplit.from_log("\n".join(log.splitlines()[:5] + log.splitlines()[6:9])).to_dict()
    assert own_head["drafter"]["model"] == 0.0 and own_head["drafter"]["kv"] == 8.0  # a second context, no model
    meta = {"general.architecture": "qwen3", "qwen3.block_count": 2, "qwen3.attention.head_count": 4,
            "qwen3.attention.head_count_kv": 2, "qwen3.embedding_length": 256}
    assert kv_cache_mib(meta, 4096) == pytest.approx(2 * 4096 * 2 * (64 + 64) * 2 / 2**20)  # f16 K and V
    assert kv_cache_mib(meta, 4096, "q8_0", "q8_0") == pytest.approx(2 * 4096 * 2 * 128 * 34 / 32 / 2**20)
    assert parse_size("12G") == 12 * 2**30 and parse_size("512m") == 512 * 2**20 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
