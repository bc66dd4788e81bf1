"""DSpark drafters (a DFlash drafter with a Markov head): the bytes of b11434's DSparkModel for full and reduced
vocabularies, with and without a confidence head, the refusals that stand in for its converter's and loader's
errors, the serving rules (draft-dspark, the n-max limit, p-min 0 without a confidence head), and llama-server
b11434 drafting with each pair."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fixtures as mf
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, llama_cpp_src, run_cli
from fixtures.drafters import DSPARK_BLOCK_SIZE, DSPARK_DRAFT_VOCAB, make_dspark_drafter
from gguf_compare import diff

from dflash_gguf.convert.targets import convert_target
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.drafters.dspark import DSparkDrafter
from dflash_gguf.ggufio.reader import read_gguf
from dflash_gguf.pipeline.serve import serve_plan
from dflash_gguf.sidecar import drafter_kind, drafter_kind_of_checkpoint, sidecar_name
from dflash_gguf.tune import TuneOptions, inspect_drafter, plan_tune
from dflash_gguf.verify import verify_files

BIN = Path(sys.executable).parent
V = mf.SIZES["qwen_vocab"]



@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dspark")


@pytest.fixture(scope="module")
def qwen3(work: Path) -> Path:
    reference.require_or_skip(reference.llama_cpp_src_available())
    return mf.make_qwen3_target(work / "t3", llama_cpp_src=llama_cpp_src())


@pytest.fixture(scope="module")
def target_gguf(qwen3: Path, work: Path) -> Path:
    out = work / "t.gguf"
    convert_target(qwen3, out, quant="q4_0")
    return out


# (case, fixture options): a DFlash-lineage Qwen3DSparkModel with and without its confidence head, a reduced
# draft vocabulary (d2t), a speculators export (transformer_layer_config, aux_hidden_state_layer_ids) and a
# full-vocabulary export whose lm_head equals its embed_tokens.
CASES: dict[str, dict] = {
    "confidence": {},
    "no_confidence": {"confidence": False},
    "d2t": {"draft_vocab": DSPARK_DRAFT_VOCAB},
    "speculators": {"style": "speculators", "confidence": False},
    "own_head_equal": {"own_head": "same"},
}


# ---------------------------------------------------------------------------------------------- parity


@pytest.mark.reference
@pytest.mark.parametrize(("case", "outtype"), [("confidence", "auto"), ("speculators", "q8_0"),
                                               ("own_head_equal", "auto")])  # d2t: in the one-pass test below
def test_dspark_matches_b11434(qwen3: Path, tmp_path: Path, case: str, outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    drafter = make_dspark_drafter(tmp_path, **CASES[case])
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, qwen3, ours, outtype)
    run = reference.run_reference_convert(drafter, qwen3, ref, outtype)
    assert run.returncode == 0, run.stderr[-3000:]
    assert diff(ours, ref) == []
    meta = read_gguf(ours)
    anchor = case != "speculators"  # EAGLE3-lineage exports use the 1+N bonus-anchor block
    assert meta.get("dflash.sample_from_anchor") is anchor
    assert meta.get("dflash.has_confidence_head") is CASES[case].get("confidence", True)
    assert "markov_w1.weight" in meta.tensors and "t2d" not in meta.tensors
    if case == "speculators":
        assert list(meta.get("dflash.target_layers")) == [2, 4]  # aux ids [2, 4] -> HF ids [1, 3] -> +1
    if case == "own_head_equal":
        assert "output.weight" not in meta.tensors  # dropped as b11434 does: token_embd is the same table
    REFERENCE_COMPARISONS.append(f"dspark/{case}/{outtype}")


@pytest.mark.reference
def test_dspark_one_pass_q4_0_is_convert_then_llama_quantize(qwen3: Path, tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    reference.require_or_skip(reference.reference_available())
    drafter = make_dspark_drafter(tmp_path, draft_vocab=DSPARK_DRAFT_VOCAB)  # d2t (I64) and conf_proj ([96, 1])
    ours, ref_bf16, ref = tmp_path / "ours.gguf", tmp_path / "ref-bf16.gguf", tmp_path / "ref.gguf"
    ours_bf16 = tmp_path / "ours-bf16.gguf"
    convert_drafter(drafter, qwen3, ours, quant="q4_0")
    convert_drafter(drafter, qwen3, ours_bf16, "bf16")
    assert reference.run_reference_convert(drafter, qwen3, ref_bf16, "bf16").returncode == 0
    assert diff(ours_bf16, ref_bf16) == []  # the reduced-vocabulary conversion itself
    meta = read_gguf(ours_bf16)
    assert meta.tensors["d2t"].type_name == "I64" and meta.tensors["d2t"].ne == (DSPARK_DRAFT_VOCAB,)
    assert meta.tensors["output.weight"].ne == (64, DSPARK_DRAFT_VOCAB) and "t2d" not in meta.tensors
    assert reference.run_llama_quantize(ref_bf16, ref, "q4_0").returncode == 0
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append("dspark/d2t/bf16")
    REFERENCE_COMPARISONS.append("dspark/one-pass-q4_0")


@pytest.mark.reference
def test_a_head_that_differs_from_the_embeddings_is_kept(qwen3: Path, target_gguf: Path, tmp_path: Path) -> None:
    """b11434 drops a full-vocabulary DSpark lm_head, and its loader then uses the drafter's token_embd as the
    output head: right only when the two tables are equal. A different head is kept as output.weight (the only
    difference from b11434's file), noted, and llama-server b11434 loads the file and drafts with it."""
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    drafter = make_dspark_drafter(tmp_path, own_head="different")
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    result = convert_drafter(drafter, qwen3, ours)
    assert any("kept as output.weight: it differs from the drafter's embed_tokens" in n for n in result.notes)
    assert reference.run_reference_convert(drafter, qwen3, ref).returncode == 0
    assert diff(ours, ref) == ["tensor names differ: only in ours ['output.weight'], only in ref []"]
    assert read_gguf(ours).tensors["output.weight"].ne == (64, V)
    with reference.start_llama_server(target_gguf, ours, n_max=4, spec_type="draft-dspark") as server:
        assert server.ready, server.output[-3000:]
        status, body = reference.http_json(server.url + "/completion", {"prompt": "hello world", "n_predict": 16,
                                                                        "temperature": 0})
    assert status == 200 and isinstance(body, dict) and body["timings"]["draft_n"] > 0, body
    assert "adding speculative implementation 'draft-dspark'" in server.output
    REFERENCE_COMPARISONS.append("dspark/own-head-different/llama-server")


# -------------------------------------------------------------------------------------------- refusals

# (case, fixture options, exit code, words of the message: the llama.cpp failure each one prevents, whether the
# config alone refuses it, so precheck does too)
D2T_OUT_OF_RANGE = {"d2t": np.arange(DSPARK_DRAFT_VOCAB, dtype=np.int64) + V}
D2T_DUPLICATE = {"d2t": np.concatenate([[1, 0], np.arange(2, DSPARK_DRAFT_VOCAB)]).astype(np.int64)}
REFUSALS = [
    ("markov_head_type", {"config_overrides": {"markov_head_type": "gated"}}, 4, ["unsupported markov_head_type"],
     True),
    ("draft_vocab_exceeds", {"config_overrides": {"draft_vocab_size": V + 1}}, 3,
     ["draft_vocab_size", "exceeds vocab_size"], True),
    ("reduced_without_d2t", {"config_overrides": {"draft_vocab_size": DSPARK_DRAFT_VOCAB}}, 5,
     ["no d2t table found"], False),
    ("d2t_out_of_range", {"draft_vocab": DSPARK_DRAFT_VOCAB, "extra_tensors": D2T_OUT_OF_RANGE}, 5,
     ["d2t target ids out of range"], False),
    ("d2t_duplicate", {"draft_vocab": DSPARK_DRAFT_VOCAB, "extra_tensors": D2T_DUPLICATE}, 5,
     ["d2t contains duplicate target ids"], False),
    ("deepseek_v4", {"config_overrides": {"architectures": ["DeepseekV4DSparkModel"]}}, 18,
     ["DeepseekV4DSparkModel", "convert_hf_to_gguf.py", "--llama-cpp DIR"], True),
]


@pytest.mark.parametrize(("case", "options", "code", "words", "config_level"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_before_writing(qwen3: Path, tmp_path: Path, case: str, options: dict, code: int,
                                 words: list[str], config_level: bool) -> None:
    drafter = make_dspark_drafter(tmp_path, **options)
    out = tmp_path / "d.gguf"
    run = run_cli("dflash-convert", "--drafter", drafter, "--target", qwen3, "--outfile", out)
    assert run.returncode == code, run.stderr
    assert all(w in run.stderr for w in words), run.stderr
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
    precheck = run_cli("dflash-gguf", "precheck", drafter, qwen3, "--json")  # the same rule, before any download
    refused = [c for c in json.loads(precheck.stdout)["checks"] if c["status"] == "fail" and c["severity"] == "error"]
    if config_level:
        assert precheck.returncode == 1 and refused[0]["id"] in ("format.dspark", "format.arch"), refused
        assert refused[0]["message"].split(" ", 1)[1][:60] in run.stderr
    else:
        assert not refused, refused


@pytest.mark.reference
def test_b11434_refuses_what_we_refuse(qwen3: Path, tmp_path: Path) -> None:
    """The quoted errors are b11434's own: its converter stops on the same checkpoints with those words."""
    reference.require_or_skip(reference.reference_available())
    for case, options, _code, words, _ in (REFUSALS[0], REFUSALS[2], REFUSALS[4]):
        drafter = make_dspark_drafter(tmp_path / case, **options)
        run = reference.run_reference_convert(drafter, qwen3, tmp_path / f"{case}.gguf")
        assert run.returncode != 0 and words[-1] in run.stderr, (case, run.stderr[-2000:])
    REFERENCE_COMPARISONS.append("dspark/refusals")


# ------------------------------------------------------------------------------------ verify, tune, serve


def test_verify_names_the_spec_type_and_flags(qwen3: Path, tmp_path: Path) -> None:
    with_conf, without = tmp_path / "c.gguf", tmp_path / "n.gguf"
    convert_drafter(make_dspark_drafter(tmp_path, draft_vocab=DSPARK_DRAFT_VOCAB), qwen3, with_conf)
    convert_drafter(make_dspark_drafter(tmp_path, style="speculators", confidence=False), qwen3, without)
    checks = {c["id"]: c for c in verify_files(with_conf).to_dict()["checks"]}
    assert checks["format.dspark"]["status"] == "pass", checks["format.dspark"]
    assert "draft-dspark" in checks["format.dspark"]["message"] and "N <= 7" in checks["format.dspark"]["message"]
    assert "d2t" in checks["format.dspark"]["message"]
    for cid in ("format.tensors", "format.shapes", "format.bias", "format.key_types"):
        assert checks[cid]["status"] == "pass", checks[cid]
    assert "DSpark set" in checks["format.tensors"]["message"]
    message = {c["id"]: c for c in verify_files(without).to_dict()["checks"]}["format.dspark"]["message"]
    assert "--spec-draft-p-min 0" in message and f"N <= {DSPARK_BLOCK_SIZE - 1}" in message, message


def test_tune_and_serve_read_the_dspark_rules(qwen3: Path, tmp_path: Path) -> None:
    anchored, bonus = tmp_path / "a.gguf", tmp_path / "b.gguf"
    convert_drafter(make_dspark_drafter(tmp_path), qwen3, anchored)
    convert_drafter(make_dspark_drafter(tmp_path, style="speculators", confidence=False), qwen3, bonus)
    a, b = inspect_drafter(anchored), inspect_drafter(bonus)
    assert isinstance(a, DSparkDrafter) and a.spec_type == "draft-dspark"
    assert a.max_n_max == DSPARK_BLOCK_SIZE and b.max_n_max == DSPARK_BLOCK_SIZE - 1  # sample_from_anchor or not
    assert a.required_p_min is None and b.required_p_min == 0.0
    target = tmp_path / "t.gguf"
    target.touch()
    plan = serve_plan(target, bonus)
    assert plan.command[plan.command.index("--spec-type") + 1] == "draft-dspark"
    assert plan.command[-2:] == ("--spec-draft-p-min", "0") and plan.p_min == 0.0
    assert "--spec-type draft-dspark" in plan.hub and "--spec-draft-p-min 0" in plan.hub
    assert "--spec-draft-p-min" not in serve_plan(target, anchored).command
    assert drafter_kind(read_gguf(bonus)) == "dspark"
    assert sidecar_name("Qwen3-tiny", "q8_0", "dspark") == "dspark-Qwen3-tiny-Q8_0.gguf"


def test_tune_sweeps_a_dspark_drafter_within_its_limit(qwen3: Path, target_gguf: Path, tmp_path: Path) -> None:
    """The coarse n-max grid goes up to block_size (an anchored DSpark drafts a full block) and every
    configuration of a drafter without a confidence head carries p-min 0 (the p-min sweep is skipped)."""
    reference.require_or_skip(reference.llama_cpp_available())
    drafter = tmp_path / "dspark-t-BF16.gguf"
    convert_drafter(make_dspark_drafter(tmp_path, confidence=False), qwen3, drafter)
    plan = plan_tune(target_gguf, [drafter], TuneOptions(quick=True, llama_server=reference.llama_bin("llama-server")))
    configs = [c for c in plan.first if c.drafter is not None]
    assert [(c.n_max, c.p_min) for c in configs] == [(4, 0.0), (1, 0.0), (3, 0.0), (DSPARK_BLOCK_SIZE, 0.0)]
    assert configs[-1].server_args()[2:] == ["--spec-type", "draft-dspark", "--spec-draft-n-max",
                                             str(DSPARK_BLOCK_SIZE), "--spec-draft-p-min", "0"]


# ------------------------------------------------------------------------------------------ llama-server

# with a confidence head and sample_from_anchor: the own-head test above; without a confidence head, anchored: the
# p-min test below
SERVED = ["d2t", "speculators"]


@pytest.mark.reference
@pytest.mark.parametrize("case", SERVED)
def test_llama_server_serves_each_dspark_pair_and_drafts(qwen3: Path, target_gguf: Path, tmp_path: Path,
                                                         case: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    drafter = tmp_path / "d.gguf"
    convert_drafter(make_dspark_drafter(tmp_path, **CASES[case]), qwen3, drafter)
    # no --spec-type: llama-server must infer draft-dspark from the file (markov_w1.weight)
    with reference.start_llama_server(target_gguf, None, extra_args=["-md", str(drafter), "--spec-draft-n-max",
                                                                     "16", "--spec-draft-p-min", "0"]) as server:
        assert server.ready, server.output[-3000:]
        status, body = reference.http_json(server.url + "/completion", {"prompt": "hello world", "n_predict": 16,
                                                                        "temperature": 0})
    assert status == 200 and isinstance(body, dict) and body["timings"]["draft_n"] > 0, body
    assert "adding speculative implementation 'draft-dspark'" in server.output
    limit = DSPARK_BLOCK_SIZE - 1 if case == "speculators" else DSPARK_BLOCK_SIZE
    assert f"clamping to {limit}" in server.output, server.output[-3000:]
    REFERENCE_COMPARISONS.append(f"llama-server/dspark/{case}")


@pytest.mark.reference
def test_llama_server_needs_p_min_0_without_a_confidence_head(qwen3: Path, target_gguf: Path, tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    drafter = tmp_path / "d.gguf"
    convert_drafter(make_dspark_drafter(tmp_path, confidence=False), qwen3, drafter)
    with reference.start_llama_server(target_gguf, drafter, n_max=4, spec_type="draft-dspark",
                                      extra_args=["--spec-draft-p-min", "0.5"]) as server:
        pass
    assert "DSpark draft has no confidence head: please set --spec-draft-p-min 0" in server.output
    REFERENCE_COMPARISONS.append("llama-server/dspark/p-min")


@pytest.mark.reference
def test_pipeline_makes_a_dspark_pair_from_the_loopback_hub(qwen3: Path, tmp_path: Path) -> None:
    """``dflash-convert --target REPO --drafter REPO`` with a DSpark drafter: b11434's drafter bytes under the
    ``dspark-`` sidecar name, and a serve command with --spec-type draft-dspark and p-min 0 (no confidence head)."""
    import hub_server
    from hub_server import FakeRepo

    reference.require_or_skip(reference.llama_cpp_available())
    reference.require_or_skip(reference.reference_available())
    drafter = make_dspark_drafter(tmp_path / "d", confidence=False)
    assert drafter_kind_of_checkpoint(drafter) == "dspark"
    files = lambda d: FakeRepo({p.name: p.read_bytes() for p in d.iterdir() if p.is_file()})  # noqa: E731
    repos = {"someone/Qwen3-tiny-DSpark": files(drafter), "Qwen/Qwen3-tiny": files(qwen3)}
    outdir = tmp_path / "pair"
    with hub_server.serve(repos) as hub:
        env = hub_server.client_env(hub.url, tmp_path / "hf") | {"LLAMA_QUANTIZE": ""}
        run = subprocess.run([str(BIN / "dflash-convert"), "--target", "Qwen/Qwen3-tiny", "--drafter",
                              "someone/Qwen3-tiny-DSpark", "--outdir", str(outdir), "--draft-quant", "bf16"],
                             capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout + run.stderr
    manifest = json.loads((outdir / "pair.json").read_text())
    assert manifest["status"] == "complete" and manifest["verify"]["servable"] is True
    name = manifest["outputs"]["drafter"]["file"]
    assert name.startswith("dspark-") and name.endswith("-BF16.gguf"), name
    serve = manifest["serve"]
    assert "--spec-type draft-dspark" in serve["with_drafter"] and "--spec-draft-p-min 0" in serve["with_drafter"]
    assert "spec-draft-p-min = 0" in (outdir / "models.ini").read_text()
    ref = tmp_path / "ref.gguf"
    assert reference.run_reference_convert(drafter, qwen3, ref, "bf16").returncode == 0
    assert diff(outdir / name, ref) == []
    REFERENCE_COMPARISONS.append("pipeline/loopback-hub/dspark")



@pytest.mark.parametrize("case", ["d2t", "speculators"])
def test_precheck_states_the_n_max_limit_draft_dspark_keeps(qwen3: Path, tmp_path: Path, case: str) -> None:
    """An anchored DSpark drafter (sample_from_anchor) drafts a full block, so n-max goes up to block_size, as
    tune's sweep and verify say; a speculators-style one up to block_size - 1."""
    from dflash_gguf.verify import precheck

    drafter = make_dspark_drafter(tmp_path, **CASES[case])
    report = precheck(drafter / "config.json", qwen3 / "config.json")
    limit = DSPARK_BLOCK_SIZE - 1 if case == "speculators" else DSPARK_BLOCK_SIZE
    assert f"--spec-draft-n-max can go up to {limit};" in report.result("pair.block_size").message
