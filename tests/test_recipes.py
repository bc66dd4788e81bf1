"""Per-tensor recipes (``--tensor-type PATTERN=TYPE``, ``--tensor-type-file``): the built-in quantizer and the
pipeline's one pass write llama-quantize b11434's bytes with the same flags, on a dense untied model, a tied one, an
8-expert one and a Qwen3.5 MoE target as our converter writes it, with and without an importance matrix; flags it
cannot read alike are refused, and a rule no tensor takes is reported."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import fixtures as mf
import gguf_compare
import pytest
import reference
from click.testing import CliRunner
from conftest import REFERENCE_COMPARISONS, run_cli
from gguf import GGMLQuantizationType as Q
from test_quant_mixtures import _llama, _qwen35, _written

from dflash_gguf.cli import main
from dflash_gguf.convert.targets import convert_target
from dflash_gguf.errors import QuantizeError
from dflash_gguf.ggufio.reader import read_gguf
from dflash_gguf.publish import plan_publish
from dflash_gguf.quantize import Overrides, quantize_gguf
from dflash_gguf.quantize.recipes import parse_tensor_type, read_tensor_type_file, recipe_from_flags

SOURCES = {
    "dense-untied": lambda p: _llama(p, n_layer=8, n_embd=256, tied=False, kv_heads=1),
    "tied": lambda p: _llama(p, n_layer=6, n_embd=256),
    "8-experts": lambda p: _llama(p, n_layer=4, n_embd=256, tied=False, experts=8),
    "qwen35-moe": _qwen35,
}

# (file type, rules): anchors, alternation, layer ranges, the output and the embedding, a 256-block type on rows it
# does not divide (the fallback), a shadowed rule, upper case (lowercased as b11434 does)
RECIPES = {
    "q4_k_m-attention-q8": ("q4_k_m", (r"attn_(q|k|v|output)=q8_0", r"^output\.weight$=q6_k")),
    "q4_k_m-layer-range": ("q4_k_m", (r"blk\.(1|[3-5])\.ffn_down=Q6_K", r"blk\.[0-9]\.ffn_(gate|up)=q5_k",
                                      "token_embd=q8_0")),
    "q4_0-everything": ("q4_0", (r"\.weight$=q8_0", "ffn_down=q4_k")),
    "q6_k-experts-and-fallback": ("q6_k", (r"ffn_(gate|up|down)_exps=q4_k", r"ATTN_NORM=q8_0", r"blk\.0\.=q5_0")),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("recipes")
    return {name: make(work / f"{name}.gguf") for name, make in SOURCES.items()}


def _rules(texts: tuple[str, ...]) -> Overrides:
    return Overrides(tensor_types=tuple(parse_tensor_type(t) for t in texts))


@pytest.mark.reference
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_recipes_match_llama_quantize(sources: dict[str, Path], tmp_path: Path, source: str) -> None:
    """Every recipe on every layout: the same type for each tensor and the same bytes (our keys aside)."""
    reference.require_or_skip(reference.llama_cpp_available())
    src = sources[source]
    for name, (type_key, texts) in RECIPES.items():
        overrides = _rules(texts)
        ours, ref = tmp_path / f"ours-{name}.gguf", tmp_path / f"ref-{name}.gguf"
        result = quantize_gguf(src, ours, type_key, quantizer="builtin", overrides=overrides)
        proc = reference.run_llama_quantize(src, ref, type_key.upper(), *overrides.args())
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert _written(ours) == _written(ref), name
        assert gguf_compare.diff(ours, ref) == [], name
        unused = [n for n in result.notes if "no tensor took" in n]
        assert all(any(n.startswith(f"--tensor-type {r.arg}:") for r in overrides.tensor_types) for n in unused)
        if name == "q6_k-experts-and-fallback":  # norms are never quantized: that rule takes no tensor anywhere
            assert any(n.startswith("--tensor-type attn_norm=q8_0:") for n in unused), unused
        REFERENCE_COMPARISONS.append(f"--tensor-type {name} on {source}")


@pytest.mark.reference
def test_recipe_with_an_importance_matrix_matches_llama_quantize(sources: dict[str, Path], tmp_path: Path) -> None:
    """With an importance matrix the recipe's types use it as llama-quantize does (weighted K-quants)."""
    reference.require_or_skip(reference.llama_cpp_available())
    src = tmp_path / "gemma4-BF16.gguf"  # a model libllama runs, for llama-imatrix
    convert_target(mf.make_gemma4_target(tmp_path / "targets"), src, "bf16")
    text = tmp_path / "calibration" / "calib.txt"
    text.parent.mkdir()
    text.write_text(" ".join(f"word{i % 97} token{i % 31}." for i in range(3000)))
    matrix = tmp_path / "imatrix" / "imatrix-dense.gguf"
    matrix.parent.mkdir()
    cmd = [str(reference.llama_bin("llama-imatrix")), "-m", str(src), "-f", text.name, "-o", str(matrix), "-c", "64",
           "--chunks", "2", "-t", "1", "--no-ppl"]
    made = subprocess.run(cmd, cwd=text.parent, capture_output=True, text=True, env=reference._bin_env(),
                          stdin=subprocess.DEVNULL, timeout=600)
    assert made.returncode == 0 and matrix.is_file(), made.stderr[-2000:]
    overrides = _rules((r"blk\.[0-1]\.ffn_down=q6_k", "attn_v=q5_k", r"ffn_up=q4_0", "attn_q=q5_0"))
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    quantize_gguf(src, ours, "q4_k_m", quantizer="builtin", overrides=overrides, imatrix=matrix)
    cmd = [str(reference.llama_bin("llama-quantize")), *overrides.args(), "--imatrix", matrix.name, str(src),
           str(ref), "Q4_K_M", "2"]
    proc = subprocess.run(cmd, cwd=matrix.parent, capture_output=True, text=True, env=reference._bin_env(),
                          stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _written(ours) == _written(ref)
    assert gguf_compare.diff(ours, ref) == []
    REFERENCE_COMPARISONS.append("--tensor-type with an importance matrix")


@pytest.mark.reference
def test_the_pipeline_one_pass_takes_the_recipe(tmp_path: Path) -> None:
    """``dflash-convert --quant Q4_K_M --tensor-type ... --tensor-type-file ...``: the target made in one pass (no
    16-bit file, no llama-quantize) is llama-quantize's file from b11434's BF16 conversion with the same flags."""
    reference.require_or_skip(reference.llama_cpp_available())
    target = mf.make_qwen3_target(tmp_path / "targets", llama_cpp_src=reference.require_llama_cpp_src())
    drafter = mf.make_drafter(tmp_path / "drafters", target="qwen3")
    recipe = tmp_path / "recipe.txt"
    recipe.write_text("attn_v=q8_0\n  ffn_down=q6_k\t token_embd=q8_0\n")
    out = tmp_path / "pair"
    proc = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out, "--quant", "Q4_K_M",
                   "--tensor-type", r"blk\.0\.attn_q=q5_0", "--tensor-type-file", recipe, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    made = sorted(out.glob("*Q4_K_M.gguf"))
    target_file = next(p for p in made if not p.name.startswith("dflash-"))
    assert not list(out.glob("*BF16*.gguf"))
    bf16 = tmp_path / "ref-bf16.gguf"
    conv = reference.run_reference_convert(target, None, bf16, "bf16")
    assert conv.returncode == 0, conv.stderr[-3000:]
    ref = tmp_path / "ref-q4_k_m.gguf"
    flags = ("--tensor-type", r"blk\.0\.attn_q=q5_0", "--tensor-type", "attn_v=q8_0", "--tensor-type",
             "ffn_down=q6_k", "--tensor-type", "token_embd=q8_0")
    proc = reference.run_llama_quantize(bf16, ref, "Q4_K_M", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert gguf_compare.diff(target_file, ref) == []
    REFERENCE_COMPARISONS.append("pipeline one pass --tensor-type = b11434 convert + llama-quantize")
    # the recipe is recorded, in order: in pair.json's options, the file's own keys and the stage key
    pair = json.loads((out / "pair.json").read_text())
    assert pair["options"]["quantize_flags"] == list(flags)
    assert pair["stages"]["target.convert"]["key"]["one_pass"] == "builtin"
    assert list(read_gguf(target_file).get("dflash_gguf.quantize_flags")) == list(flags)
    card = plan_publish(out, "someone/qwen3-tiny-GGUF", license="apache-2.0").card
    assert f"- the target's llama-quantize flags, in the order they apply: `{shlex.join(flags)}`" in card


def test_tensor_type_flags_are_read_as_llama_quantize_reads_them(tmp_path: Path) -> None:
    rule = parse_tensor_type(r"BLK\.[0-9]+\.ATTN_V=Q8_0")
    assert (rule.pattern, rule.type_name, rule.qtype) == (r"blk\.[0-9]+\.attn_v", "q8_0", Q.Q8_0)
    assert rule.matches("blk.12.attn_v.weight") and not rule.matches("blk.12.attn_k.weight")
    with pytest.raises(QuantizeError, match="'b=q4_0' is not a ggml type.*q4_0.*q8_0"):
        parse_tensor_type("a=b=q4_0")  # split at the first '=', as b11434 does
    for bad, said in (("attn_v", "no '='"), ("=q8_0", "no a tensor name pattern"), ("attn_v=", "no a type"),
                      ("attn_v=q9_9", "not a ggml type"), ("(?i)attn=q8_0", "read differently"),
                      (r"(?P<b>blk)\.0=q8_0", "read differently"), ("attn_(v=q8_0", "not a regular expression")):
        with pytest.raises(QuantizeError, match=said.replace("(", r"\(")):
            parse_tensor_type(bad)
    recipe = tmp_path / "r.txt"
    recipe.write_text("attn_v=q8_0\n\n ffn_down=Q6_K ")
    assert [r.arg for r in read_tensor_type_file(recipe)] == ["attn_v=q8_0", "ffn_down=q6_k"]
    assert [r.arg for r in recipe_from_flags(("output=q8_0",), recipe)] == ["output=q8_0", "attn_v=q8_0",
                                                                           "ffn_down=q6_k"]
    with pytest.raises(QuantizeError, match="r.txt"):
        recipe.write_text("attn_v=q8_0 bogus")
        read_tensor_type_file(recipe)


def test_a_rule_no_tensor_takes_is_reported_and_an_unmakeable_type_refused(tmp_path: Path) -> None:
    src = _llama(tmp_path / "in.gguf", n_layer=2, n_embd=256, tied=False)
    out = tmp_path / "o.gguf"
    res = CliRunner().invoke(main, ["quantize", str(src), str(out), "q4_0", "--quantizer", "builtin",
                                    "--tensor-type", "attn_v=q8_0", "--tensor-type", "nothing_here=q8_0",
                                    "--tensor-type", "attn_v.weight=q6_k", "--json"])
    assert res.exit_code == 0, res.output
    notes = json.loads(res.stdout)["notes"]
    assert any(n.startswith("--tensor-type nothing_here=q8_0: no tensor took") for n in notes), notes
    assert any(n.startswith("--tensor-type attn_v.weight=q6_k: no tensor took") for n in notes), notes
    assert not any(n.startswith("--tensor-type attn_v=q8_0") for n in notes)
    assert _written(out)["blk.0.attn_v.weight"] == "Q8_0"
    res = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "p.gguf"), "q4_0", "--quantizer", "builtin",
                                    "--tensor-type", "attn_v=iq2_xxs"])
    assert res.exit_code != 0 and "attn_v=iq2_xxs" in res.output and "llama-quantize" in res.output
    assert not (tmp_path / "p.gguf").exists()


@pytest.mark.reference
def test_auto_hands_a_type_only_llama_quantize_makes_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--quantizer auto with a rule naming a type the built-in does not make (IQ4_NL): llama-quantize makes the file,
    given the same rules, and it is llama-quantize's file by hand; with the built-in named, it is refused up front."""
    reference.require_or_skip(reference.llama_cpp_available())
    monkeypatch.setenv("LLAMA_QUANTIZE", str(reference.llama_bin("llama-quantize")))
    src = _llama(tmp_path / "in.gguf", n_layer=2, n_embd=256, tied=False)
    overrides = _rules(("attn_v=iq4_nl", "ffn_down=q6_k"))
    result = quantize_gguf(src, tmp_path / "auto.gguf", "q4_k_m", overrides=overrides)
    assert result.quantizer == "llama-quantize"
    proc = reference.run_llama_quantize(src, tmp_path / "hand.gguf", "Q4_K_M", *overrides.args())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "auto.gguf").read_bytes() == (tmp_path / "hand.gguf").read_bytes()
    assert _written(tmp_path / "auto.gguf")["blk.0.attn_v.weight"] == "IQ4_NL"
    with pytest.raises(QuantizeError, match="attn_v=iq4_nl: the built-in quantizer makes"):
        quantize_gguf(src, tmp_path / "builtin.gguf", "q4_k_m", quantizer="builtin", overrides=overrides)
    assert not (tmp_path / "builtin.gguf").exists()
    REFERENCE_COMPARISONS.append("--tensor-type iq4_nl with --quantizer auto = llama-quantize by hand")


@pytest.mark.reference
def test_a_named_recipe_is_a_tag_of_its_own(tmp_path: Path) -> None:
    """``--quant Q4_K_M --recipe A8=Q4_K_M:FILE --recipe MIX6=q6_k:FILE``: three tags from one read of the
    checkpoint, each recipe's target named with its tag (``-hf REPO:A8``) and byte for byte llama-quantize's file from
    b11434's BF16 conversion with the recipe's rules (and only those: the run's --tensor-type stays with --quant's tag),
    each with its drafter named alike; the recipes recorded in pair.json and in each file."""
    reference.require_or_skip(reference.llama_cpp_available())
    target = mf.make_qwen3_target(tmp_path / "targets", llama_cpp_src=reference.require_llama_cpp_src())
    drafter = mf.make_drafter(tmp_path / "drafters", target="qwen3")
    (tmp_path / "attn.txt").write_text(r"attn_(q|k|v|output)=q8_0 ^output\.weight$=q6_k")
    (tmp_path / "mix.txt").write_text(r"blk\.(0|2)\.ffn_down=q8_0 token_embd=q4_k")
    out = tmp_path / "pair"
    proc = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out, "--quant", "Q4_K_M",
                   "--tensor-type", r"blk\.0\.attn_q=q5_0", "--recipe", f"A8=Q4_K_M:{tmp_path / 'attn.txt'}",
                   "--recipe", f"MIX6=q6_k:{tmp_path / 'mix.txt'}", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from dflash_gguf.pipeline.naming import encoding_tag

    name = target.name
    pair = json.loads((out / "pair.json").read_text())
    assert pair["options"]["tags"] == ["q4_k_m", "A8", "MIX6"]
    assert pair["options"]["recipes"] == [
        {"name": "A8", "type": "q4_k_m", "file": "attn.txt",
         "rules": ["attn_(q|k|v|output)=q8_0", r"^output\.weight$=q6_k"]},
        {"name": "MIX6", "type": "q6_k", "file": "mix.txt", "rules": [r"blk\.(0|2)\.ffn_down=q8_0", "token_embd=q4_k"]}]
    tags = {t["tag"]: t for t in pair["outputs"]["tags"]}
    assert {t: (r["target"]["file"], r["target"]["type"], r["drafter"]["file"]) for t, r in tags.items()} == {
        "q4_k_m": (f"{name}-Q4_K_M.gguf", "q4_k_m", f"dflash-{name}-Q4_K_M.gguf"),
        "A8": (f"{name}-A8.gguf", "q4_k_m", f"dflash-{name}-A8.gguf"),
        "MIX6": (f"{name}-MIX6.gguf", "q6_k", f"dflash-{name}-MIX6.gguf")}
    assert [encoding_tag(f) for f in (f"{name}-A8.gguf", f"dflash-{name}-MIX6.gguf")] == ["A8", "MIX6"]
    assert not list(out.glob("*BF16*.gguf"))  # one pass
    bf16 = tmp_path / "ref-bf16.gguf"
    conv = reference.run_reference_convert(target, None, bf16, "bf16")
    assert conv.returncode == 0, conv.stderr[-3000:]
    for file, type_name, rules in ((f"{name}-A8.gguf", "Q4_K_M", pair["options"]["recipes"][0]["rules"]),
                                   (f"{name}-MIX6.gguf", "Q6_K", pair["options"]["recipes"][1]["rules"]),
                                   (f"{name}-Q4_K_M.gguf", "Q4_K_M", [r"blk\.0\.attn_q=q5_0"])):
        flags = [arg for rule in rules for arg in ("--tensor-type", rule)]
        ref = tmp_path / f"ref-{file}"
        proc = reference.run_llama_quantize(bf16, ref, type_name, *flags)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert gguf_compare.diff(out / file, ref) == [], file
        assert list(read_gguf(out / file).get("dflash_gguf.quantize_flags")) == flags
    REFERENCE_COMPARISONS.append("pipeline --recipe NAME=TYPE:FILE tags = b11434 convert + llama-quantize")
    card = plan_publish(out, "someone/qwen3-tiny-GGUF", license="apache-2.0").card
    assert (r"- tag A8: Q4_K_M with the rules of `attn.txt`, in the order they apply: `--tensor-type "
            r"'attn_(q|k|v|output)=q8_0' --tensor-type '^output\.weight$=q6_k'`") in card, card
    drafter_kv = read_gguf(out / f"dflash-{name}-MIX6.gguf")  # the drafter: made as the recipe's type, no rules
    assert drafter_kv.get("general.file_type") == 18 and drafter_kv.get("dflash_gguf.quantize_flags") is None


def test_a_named_recipe_is_refused_before_anything_is_fetched(tmp_path: Path) -> None:
    recipe = tmp_path / "r.txt"
    recipe.write_text("attn_v=q8_0")
    target, drafter = tmp_path / "no-target", tmp_path / "no-drafter"  # never read: the flags are judged first
    for spec, code, said in ((f"Q8_0=q4_k_m:{recipe}", 2, "is the name of a quant type"),
                             (f"my-mix=q4_k_m:{recipe}", 8, "letters, digits"),
                             (f"my.mix=q4_k_m:{recipe}", 8, "letters, digits"),
                             (f"MIX=q4_k_m:{tmp_path / 'missing.txt'}", 8, "cannot read it"),
                             (f"MIX=q9_k:{recipe}", 8, "q9_k"),
                             (f"q4_k_m:{recipe}", 8, "NAME=BASE_TYPE:FILE")):
        proc = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--quant", "q4_k_m", "--recipe",
                       spec, "--outdir", tmp_path / "out", "--dry-run")
        assert proc.returncode == code and said in proc.stderr, (spec, proc.returncode, proc.stderr)
    assert not (tmp_path / "out").exists()
    # a tag -hf could not tell from another (llama.cpp takes the first file holding 'TAG' then '.' or '-'), judged
    # once the target's name is known, before any weight
    target = mf.make_gemma4_target(tmp_path / "t")
    drafter = mf.make_drafter(tmp_path / "d", target="gemma4")
    for spec, other in ((f"K_M=q4_k_m:{recipe}", "Q4_K_M"), (f"XQ4_K_M=q6_k:{recipe}", "Q4_K_M"),
                        (f"IT=q6_k:{recipe}", "Q4_K_M")):  # the model's name holds '-it-'
        proc = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--quant", "q4_k_m", "--recipe",
                       spec, "--outdir", tmp_path / "out", "--dry-run")
        assert proc.returncode == 2 and "cannot be told apart" in proc.stderr and other in proc.stderr, proc.stderr
    ok = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--quant", "q4_k_m", "--recipe",
                 f"Q4_K_A8=q4_k_m:{recipe}", "--outdir", tmp_path / "out", "--dry-run", "--json")
    assert ok.returncode == 0, ok.stderr
    files = [o["file"] for o in json.loads(ok.stdout)["plan"]["outputs"]]
    assert f"{target.name}-Q4_K_A8.gguf" in files and f"dflash-{target.name}-Q4_K_A8.gguf" in files, files
