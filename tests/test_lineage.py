"""Lineage on files nobody here wrote: targets and drafters converted by llama.cpp b11434's own converter.

Their only evidence is what gguf-py's ``Metadata`` copies from the model card into ``general.*``; none of
these files has a ``dflash_gguf.*`` key. Each target is verified with a drafter whose card names its
target, with one that names nothing, and alone; the same folders go through the config-level precheck.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fixtures as mf
import pytest
import reference
from click.testing import CliRunner
from conftest import REFERENCE_COMPARISONS

from dflash_gguf.cli.verify import verify_cmd
from dflash_gguf.verify import precheck, read_gguf
from dflash_gguf.verify.lineage import Evidence, ModelIdentity, judge

INTENDED = "google/gemma-4-tiny-it"
QAT_INTENDED = "google/gemma-4-tiny-it-qat-q4_0-unquantized"


def _card(base_model: str, *, relation: str | None = None, tags: tuple[str, ...] = ()) -> str:
    lines = ["---", "license: apache-2.0", f"base_model: {base_model}"]
    lines += [f"base_model_relation: {relation}"] if relation else []
    lines += ["tags:", *(f"- {t}" for t in tags)] if tags else []
    return "\n".join([*lines, "---", "", "# fixture", ""])


# name -> (folder name, card, derived when the drafter's target is known, derived when it is not)
TARGETS: dict[str, tuple[str, str, bool, bool]] = {
    # the official instruct model, whose card names its pretrained base: not evidence of anything
    "plain": ("gemma-4-tiny-it", _card("google/gemma-4-tiny-pt", relation="finetune"), False, False),
    "qat": ("gemma-4-tiny-it-qat-q4_0-unquantized",
            _card(INTENDED, relation="quantized", tags=("gemma4", "qat", "q4_0")), True, True),
    "abliterated": ("gemma-4-tiny-it-abliterated", _card(INTENDED, tags=("abliterated", "uncensored")), True, True),
    "merged": ("gemmerald-4-tiny", _card(f"[{INTENDED}, someone/gemma-4-tiny-roleplay]", tags=("mergekit", "merge")),
               True, True),
    # re-trained with no marker in any name: only a known intended target can tell
    "retrained": ("gemma-4-tiny-it-sft-v2", _card(INTENDED), True, False),
}


@pytest.fixture(scope="module")
def ref_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Target and drafter folders, and their GGUFs made by b11434's convert_hf_to_gguf.py."""
    reference.require_or_skip(reference.reference_available())
    root = tmp_path_factory.mktemp("lineage")
    out: dict[str, Path] = {}
    for key, (name, card, _, _) in TARGETS.items():
        made = mf.make_gemma4_target(root / key)
        folder = made if made.name == name else Path(shutil.move(made, made.parent / name))
        (folder / "README.md").write_text(card, encoding="utf-8")
        gguf = root / f"{name}-BF16.gguf"
        proc = reference.run_reference_convert(folder, None, gguf)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[f"{key}_dir"], out[key] = folder, gguf
    drafters = (("drafter_known", _card(INTENDED, tags=("dflash",)), "plain"), ("drafter_anon", None, "plain"),
                ("drafter_qat", _card(QAT_INTENDED, tags=("dflash",)), "qat"))
    for key, readme, target in drafters:
        folder = mf.make_drafter(root / key, target="gemma4")
        if readme:
            (folder / "README.md").write_text(readme, encoding="utf-8")
        gguf = root / key / "gemma4-tiny-it-DFlash-BF16.gguf"
        proc = reference.run_reference_convert(folder, out[f"{target}_dir"], gguf)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[f"{key}_dir"], out[key] = folder, gguf
    return out


def _verify(*args: Path | str) -> tuple[int, dict[str, dict]]:
    result = CliRunner().invoke(verify_cmd, [*map(str, args), "--json"])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, {c["id"]: c for c in json.loads(result.output)["checks"]}


@pytest.mark.reference
def test_reference_files_carry_no_keys_of_ours(ref_files: dict[str, Path]) -> None:
    for key in (*TARGETS, "drafter_known", "drafter_anon"):
        meta = read_gguf(ref_files[key])
        assert not [k for k in meta.kv if k.startswith("dflash_gguf.")]
    assert read_gguf(ref_files["qat"]).get("general.name") == "Gemma 4 Tiny It Qat Q4_0 Unquantized"
    REFERENCE_COMPARISONS.append("lineage/b11434-general-keys")


@pytest.mark.parametrize("target", list(TARGETS))
def test_pair_with_drafter_whose_card_names_its_target(ref_files: dict[str, Path], target: str) -> None:
    code, checks = _verify(ref_files["drafter_known"], ref_files[target])
    derived = TARGETS[target][2]
    assert code == int(derived), checks
    assert f"'{INTENDED}'" in checks["lineage.intended_target"]["message"]
    assert "general.base_model.0.repo_url" in checks["lineage.intended_target"]["message"]
    check = checks["lineage.derived_target"]
    assert check["status"] == ("fail" if derived else "pass")
    if derived:
        assert check["fix"].startswith(f"Serve the drafter with the model it was trained on: '{INTENDED}'")


@pytest.mark.parametrize("target", list(TARGETS))
def test_pair_with_drafter_that_names_nothing(ref_files: dict[str, Path], target: str) -> None:
    code, checks = _verify(ref_files["drafter_anon"], ref_files[target])
    derived = TARGETS[target][3]
    assert code == int(derived), checks
    assert checks["lineage.intended_target"]["status"] == "fail"  # a warning: nothing names the target
    assert checks["lineage.derived_target"]["status"] == ("fail" if derived else "pass")


@pytest.mark.parametrize("target", list(TARGETS))
def test_target_alone(ref_files: dict[str, Path], target: str) -> None:
    code, checks = _verify(ref_files[target])
    assert code == int(TARGETS[target][3]), checks
    assert checks["pair.target_arch"]["status"] == "pass"
    assert checks["pair.drafter"]["status"] == "skip"


@pytest.mark.parametrize("drafter", ["drafter_known", "drafter_anon"])
def test_drafter_alone(ref_files: dict[str, Path], drafter: str) -> None:
    code, checks = _verify(ref_files[drafter])
    assert code == 0, checks
    assert checks["format.arch"]["status"] == "pass"


def test_qat_message_names_the_evidence_and_the_override(ref_files: dict[str, Path]) -> None:
    _, checks = _verify(ref_files["drafter_anon"], ref_files["qat"])
    message = checks["lineage.derived_target"]["message"]
    assert "general.name 'Gemma 4 Tiny It Qat Q4_0 Unquantized' says quantization-aware trained (QAT)" in message
    assert "general.tags 'qat'" in message
    code, allowed = _verify(ref_files["drafter_anon"], ref_files["qat"], "--allow-derived-target")
    assert code == 0, allowed
    assert allowed["lineage.derived_target"]["severity"] == "warning"
    assert "allowed by --allow-derived-target" in allowed["lineage.derived_target"]["message"]


@pytest.mark.reference
def test_right_target_quantized_by_llama_quantize_passes(ref_files: dict[str, Path], tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    for ftype in ("Q8_0", "Q4_0"):
        quantized = tmp_path / f"gemma-4-tiny-it-{ftype}.gguf"
        proc = reference.run_llama_quantize(ref_files["plain"], quantized, ftype)
        assert proc.returncode == 0, proc.stderr[-3000:]
        code, checks = _verify(ref_files["drafter_known"], quantized)
        assert code == 0, checks
        assert checks["lineage.derived_target"]["status"] == "pass"
        qat = tmp_path / f"qat-{ftype}.gguf"
        assert reference.run_llama_quantize(ref_files["qat"], qat, ftype).returncode == 0
        assert _verify(ref_files["drafter_known"], qat)[0] == 1  # llama-quantize keeps general.*
    REFERENCE_COMPARISONS.append("lineage/llama-quantize-keeps-general")


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("drafter", ["drafter_known", "drafter_anon"])
def test_precheck_on_the_same_folders(ref_files: dict[str, Path], target: str, drafter: str) -> None:
    d, t = ref_files[f"{drafter}_dir"], ref_files[f"{target}_dir"]
    card = lambda p: (p / "README.md").read_text(encoding="utf-8") if (p / "README.md").is_file() else None  # noqa: E731
    report = precheck(d / "config.json", t / "config.json", drafter_repo=d.name, target_repo=t.name,
                      drafter_card=card(d), target_card=card(t))
    derived = TARGETS[target][2 if drafter == "drafter_known" else 3]
    assert report.exit_code == int(derived), [r for r in report.results if r.status == "fail"]
    assert report.result("lineage.derived_target").status == ("fail" if derived else "pass")


def _ident(*names: str, bases: tuple[str, ...] = (), tags: tuple[str, ...] = ()) -> ModelIdentity:
    return ModelIdentity(tuple(Evidence("general.name", n) for n in names), tuple(Evidence("general.tags", t)
                         for t in tags), tuple(Evidence("general.base_model.0.repo_url", b) for b in bases))


@pytest.mark.parametrize(
    ("intended", "target", "kind"),
    [
        # quantizers' repos name the right model behind an org prefix or a -GGUF suffix: the same weights
        ("google/gemma-4-12B-it", _ident("bartowski/google_gemma-4-12b-it-GGUF",
                                         bases=("https://huggingface.co/google/gemma-4-12B-it",)), "match"),
        ("google/gemma-4-12B-it", _ident("Gemma 4 12B It", "gemma-4-12B-it-Q4_K_M.gguf",
                                         bases=("https://huggingface.co/google/gemma-4-12B-it",)), "match"),
        ("meta-llama/Llama-3.1-8B-Instruct", _ident("Llama 3.1 8B Instruct"), "match"),
        # a drafter trained on a QAT or distilled model expects exactly that model
        ("google/gemma-4-12B-it-qat-q4_0-unquantized", _ident("Gemma 4 12B It Qat Q4_0 Unquantized"), "match"),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", _ident("DeepSeek R1 Distill Qwen 7B"), "match"),
        # ...but a further derivative of it is not
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", _ident("DeepSeek R1 Distill Qwen 7B Abliterated"), "derived"),
        ("google/gemma-4-12B-it", _ident("Gemma 4 12B It Quantization Aware"), "derived"),
        ("google/gemma-4-12B-it", _ident("Gemma 4 12B It", tags=("mergekit",)), "derived"),
        ("google/gemma-4-12B-it", _ident("gemma-4-31B-it"), "size"),
        # ...and the other way round: a drafter trained on a derivative is refused on the original
        ("google/gemma-4-12B-it-qat-q4_0-unquantized", _ident("Gemma 4 12B It"), "underived"),
        ("google/gemma-4-12B-it-qat-q4_0-unquantized", _ident("Gemma 4 12B It", "gemma-4-12B-it-Q4_0.gguf",
                                                              bases=("google/gemma-4-12B-pt",)), "underived"),
        ("google/gemma-4-12B-it-qat-q4_0-unquantized", _ident("gemma-4-12b-it-qat-q4_0-gguf"), "match"),
        ("google/gemma-4-12B-it-qat-q4_0-unquantized", _ident("Gemma 4 12B It", tags=("qat",)), "match"),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", _ident("DeepSeek R1 Qwen 7B"), "underived"),
        ("mlabonne/gemma-4-12B-it-abliterated", _ident("Gemma 4 12B It"), "underived"),
        ("mlabonne/gemma-4-12B-it-abliterated", _ident("Gemma 4 12B It Abliterated"), "match"),
        (None, _ident("Gemma 4 12B It", bases=("https://huggingface.co/google/gemma-4-12B-pt",)), "unmarked"),
        # a fine-tune under its own name, whose card names the intended model as its base: a derived model
        ("google/gemma-4-12B-it", _ident("Hermes 5 Gemma 4 12B", bases=("google/gemma-4-12B-it",)), "derived"),
        # the same model behind another org (a mirror), or as a repack of the QAT checkpoint
        ("google/gemma-4-12B-it", _ident("unsloth/gemma-4-12B-it"), "match"),
        ("google/gemma-4-12B-it-qat-q4_0-unquantized",
         _ident("bartowski/google_gemma-4-12b-it-qat-q4_0-unquantized-GGUF"), "match"),
        # sizes differ, each way and under a QAT name
        ("google/gemma-4-31B-it", _ident("gemma-4-12B-it"), "size"),
        ("google/gemma-4-12B-it-qat-q4_0-unquantized", _ident("gemma-4-31B-it-qat-q4_0-unquantized"), "size"),
        ("Qwen/Qwen3-30B-A3B", _ident("Qwen3 30B A6B"), "size"),
    ],
)
def test_judge_on_published_names(intended: str | None, target: ModelIdentity, kind: str) -> None:
    kinds = [f.kind for f in judge(intended, target)]
    assert kind in kinds, kinds
    if kind == "match":
        assert kinds == ["match"]


@pytest.mark.parametrize("allow", [False, True])
def test_a_qat_drafter_on_the_original_target_is_refused_with_the_same_check(allow: bool) -> None:
    from dflash_gguf.drafters.findings import Report
    from dflash_gguf.verify.lineage import report_lineage

    intended = "google/gemma-4-12B-it-qat-q4_0-unquantized"
    report = Report()
    report_lineage(report, judge(intended, _ident("Gemma 4 12B It")), intended, allow)
    result = report.result("lineage.derived_target")
    assert result.status == "fail" and result.severity == ("warning" if allow else "error")
    assert "which is quantization-aware trained (QAT)" in result.message and "'Gemma 4 12B It'" in result.message
    assert report.exit_code == (0 if allow else 1)


@pytest.mark.parametrize(("target", "refused"), [("qat", False), ("plain", True)])
def test_a_drafter_trained_for_the_qat_target_is_refused_on_the_original(ref_files: dict[str, Path], target: str,
                                                                        refused: bool) -> None:
    """The other half of the QAT mismatch, from b11434's files and from the same folders: the drafter's card names
    the QAT checkpoint, and the original target (no QAT marker in any name or tag) is refused with the same check
    and exit code as a QAT target under a drafter of the original."""
    code, checks = _verify(ref_files["drafter_qat"], ref_files[target])
    assert code == int(refused), checks
    assert f"'{QAT_INTENDED}'" in checks["lineage.intended_target"]["message"]
    check = checks["lineage.derived_target"]
    assert check["status"] == ("fail" if refused else "pass"), check
    d, t = ref_files["drafter_qat_dir"], ref_files[f"{target}_dir"]
    report = precheck(d / "config.json", t / "config.json", drafter_repo=d.name, target_repo=t.name,
                      drafter_card=(d / "README.md").read_text(encoding="utf-8"),
                      target_card=(t / "README.md").read_text(encoding="utf-8"))
    assert report.exit_code == int(refused), [r for r in report.results if r.status == "fail"]
    if refused:
        assert "which is quantization-aware trained (QAT)" in check["message"], check
        assert check["fix"].startswith(f"Serve the drafter with the model it was trained on: '{QAT_INTENDED}'")
        code, allowed = _verify(ref_files["drafter_qat"], ref_files[target], "--allow-derived-target")
        assert code == 0 and allowed["lineage.derived_target"]["severity"] == "warning", allowed


@pytest.mark.parametrize(("target", "refused"), [("qat", False), ("plain", True)])
def test_a_qat_mtp_assistant_is_refused_on_the_original_target(tmp_path: Path, target: str, refused: bool) -> None:
    """Google ships an MTP assistant per lineage (``<target>-assistant``): the QAT one on the original target is the
    mismatch the other way round, caught from the folders (names and cards) as the DFlash drafter is."""
    from fixtures.gemma4_assistant import make_gemma4_assistant

    name, card, _, _ = TARGETS[target]
    target_dir = mf.make_gemma4_target(tmp_path / "t")
    (target_dir / "README.md").write_text(card, encoding="utf-8")
    assistant = make_gemma4_assistant(tmp_path / "a", name="gemma-4-tiny-it-qat-q4_0-unquantized-assistant")
    (assistant / "README.md").write_text(_card(QAT_INTENDED), encoding="utf-8")
    report = precheck(assistant / "config.json", target_dir / "config.json", drafter_repo=assistant.name,
                      target_repo=name, drafter_card=_card(QAT_INTENDED), target_card=card)
    assert report.exit_code == int(refused), [r for r in report.results if r.status == "fail"]
    check = report.result("lineage.derived_target")
    assert check is not None and check.status == ("fail" if refused else "pass"), check


def test_tune_names_the_lineage_mismatch_behind_a_collapse() -> None:
    """tune's verdict on a collapsed drafter quotes what the files' names show (item 4 of lineage both ways)."""
    from dflash_gguf.drafters import Drafter
    from dflash_gguf.tune.report import Configuration, Measurement, Sample, ServerInfo, TuneReport
    from dflash_gguf.tune.workload import Workload

    d = Drafter(Path("gemma4-tiny-it-DFlash-BF16.gguf"), "dflash", "draft-dflash", 16, "BF16")
    ms = tuple(Measurement(c, "ok", (Sample("code", 1, 1.0, 64, 100.0, drafted, 0),), 1)
               for c, drafted in ((Configuration(), 0), (Configuration(d, 4), 400)))
    why = f"the drafter was trained for '{QAT_INTENDED}', which is quantization-aware trained (QAT), ..."
    report = TuneReport(Path("t.gguf"), (d,), Workload(), "off", ServerInfo(Path("s"), "PATH"), (), ms, None, 1.0,
                        lineage=((d.path.name, why),))
    assert report.collapsed == (d,) and f"The files show a lineage mismatch: {why}" in report.verdict
    assert report.to_dict()["lineage"] == {d.path.name: why}


@pytest.mark.reference
def test_tune_on_a_qat_drafter_and_the_original_target_says_why_acceptance_collapsed(
        ref_files: dict[str, Path]) -> None:
    """Allowed past verify, the mismatched pair from b11434's converter is measured: acceptance collapses (exit 15),
    and the verdict names the lineage mismatch the files show."""
    from conftest import run_tune

    proc, doc = run_tune(ref_files["plain"], ref_files["drafter_qat"], "--methods", "drafters", "--n-max", "3",
                         "--n-predict", "32", "--repeats", "1", "--json", "--", "-t", "1")
    assert proc.returncode == 15, proc.stderr[-3000:]
    name = ref_files["drafter_qat"].name
    assert doc["collapsed"] == [name]
    assert "which is quantization-aware trained (QAT)" in doc["lineage"][name]
    assert "The files show a lineage mismatch" in doc["verdict"]
    REFERENCE_COMPARISONS.append("llama-server/tune-lineage-collapse")


@pytest.mark.reference
@pytest.mark.parametrize(("drafter", "target", "refused"), [("qat", "qat", False), ("qat", "plain", True),
                                                             ("plain", "qat", True), ("plain", "plain", False)])
def test_mtp_assistants_from_b11434s_converter_are_judged_both_ways(tmp_path: Path, drafter: str, target: str,
                                                                     refused: bool) -> None:
    """GGUFs nobody here wrote: assistants and targets converted by b11434, their only evidence the general.* keys
    gguf-py copies from the cards. Each lineage with its own target passes; crossed, either way, is refused."""
    from fixtures.gemma4_assistant import make_gemma4_assistant

    names = {"plain": ("gemma-4-tiny-it", INTENDED), "qat": ("gemma-4-tiny-it-qat-q4_0-unquantized", QAT_INTENDED)}
    t_name, _ = names[target]
    a_name, a_base = names[drafter]
    made = mf.make_gemma4_target(tmp_path / "t")
    t_dir = made if made.name == t_name else Path(shutil.move(made, made.parent / t_name))
    (t_dir / "README.md").write_text(TARGETS[target][1], encoding="utf-8")
    a_dir = make_gemma4_assistant(tmp_path / "a", name=f"{a_name}-assistant")
    (a_dir / "README.md").write_text(_card(a_base), encoding="utf-8")
    t_gguf, a_gguf = tmp_path / f"{t_name}-BF16.gguf", tmp_path / f"{a_name}-assistant-BF16.gguf"
    for folder, out in ((t_dir, t_gguf), (a_dir, a_gguf)):
        proc = reference.run_reference_convert(folder, None, out)
        assert proc.returncode == 0, proc.stderr[-3000:]
    code, checks = _verify(a_gguf, t_gguf)
    assert code == int(refused), {k: v for k, v in checks.items() if v["status"] == "fail"}
    assert checks["lineage.derived_target"]["status"] == ("fail" if refused else "pass")
    REFERENCE_COMPARISONS.append(f"lineage/b11434-assistant/{drafter}-on-{target}")


@pytest.mark.parametrize("published", [True, False])
def test_the_pipeline_names_the_matching_assistant_only_when_the_hub_has_it(tmp_path: Path, published: bool) -> None:
    """A QAT assistant with the original Gemma-4 target from the loopback Hub: refused before any weight is fetched,
    with the same check precheck and verify use, and the assistant made for this target named when it exists."""
    import hub_server
    from conftest import run_cli
    from fixtures.gemma4_assistant import make_gemma4_assistant
    from hub_server import FakeRepo

    target = mf.make_gemma4_target(tmp_path / "t")
    (target / "README.md").write_text(TARGETS["plain"][1], encoding="utf-8")
    qat = make_gemma4_assistant(tmp_path / "q", name="gemma-4-tiny-it-qat-q4_0-unquantized-assistant")
    (qat / "README.md").write_text(_card(QAT_INTENDED), encoding="utf-8")
    repos = {INTENDED: FakeRepo.of_folder(target), f"{QAT_INTENDED}-assistant": FakeRepo.of_folder(qat)}
    if published:
        plain = make_gemma4_assistant(tmp_path / "p")
        (plain / "README.md").write_text(_card(INTENDED), encoding="utf-8")
        repos[f"{INTENDED}-assistant"] = FakeRepo.of_folder(plain)
    with hub_server.serve(repos) as hub:
        env = hub_server.client_env(hub.url, tmp_path / "hf")
        run = run_cli("dflash-convert", "--target", INTENDED, "--drafter", f"{QAT_INTENDED}-assistant", "--outdir",
                      tmp_path / "out", env=env)
        pre = run_cli("dflash-gguf", "precheck", f"{QAT_INTENDED}-assistant", INTENDED, env=env)
    assert run.returncode == 6 and "[lineage.derived_target]" in run.stderr, run.stderr
    assert "which is quantization-aware trained (QAT)" in run.stderr
    assert (f"The assistant made for this target is on the Hub: --drafter {INTENDED}-assistant" in run.stderr) \
        is published, run.stderr
    assert pre.returncode == 1 and "lineage.derived_target" in pre.stdout, pre.stdout + pre.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.gguf"))


@pytest.mark.reference
def test_outfile_then_verify_gives_the_verdict_precheck_gives(ref_files: dict[str, Path], tmp_path: Path) -> None:
    """The drafter trained for the QAT checkpoint converted with --outfile against the original target (as llama.cpp's
    converter would, no judgement), then verified with the original target GGUF from b11434: refused with the check
    precheck and the pipeline use."""
    from conftest import run_cli

    d, t = ref_files["drafter_qat_dir"], ref_files["plain_dir"]
    out = tmp_path / "gemma4-tiny-it-DFlash-BF16.gguf"
    made = run_cli("dflash-convert", "--drafter", d, "--target", t, "--outfile", out)
    assert made.returncode == 0, made.stdout + made.stderr
    code, checks = _verify(out, ref_files["plain"])
    assert code == 1 and checks["lineage.derived_target"]["status"] == "fail", checks["lineage.derived_target"]
    assert "which is quantization-aware trained (QAT)" in checks["lineage.derived_target"]["message"]
    pre = precheck(d / "config.json", t / "config.json", drafter_repo=d.name, target_repo=t.name,
                   drafter_card=(d / "README.md").read_text(encoding="utf-8"),
                   target_card=(t / "README.md").read_text(encoding="utf-8"))
    assert pre.exit_code == 1 and pre.result("lineage.derived_target").status == "fail"
    REFERENCE_COMPARISONS.append("lineage/outfile+verify/qat-drafter-on-original")
