"""Gemma-4 MTP assistants, as b11434's ``Gemma4AssistantModel`` (conversion/gemma.py) writes them.

b11434's class is a ``Gemma4Model`` subclass, so this family is a :class:`~.gemma4.Gemma4Family` subclass and
every Gemma-4 rule (keys, per-layer-type heads, rope_freqs, vocabulary, token_embd trim) is reused. What differs:

* general.architecture ``gemma4-assistant``; after Gemma4Model's keys, ``embedding_length_out`` =
  ``backbone_hidden_size`` (the target's width) and ``nextn_predict_layers`` = the block count;
* ``pre_projection`` / ``post_projection`` -> ``nextn.pre_projection`` {2*backbone, n_embd} and
  ``nextn.post_projection`` {n_embd, backbone}; ``masked_embedding.*`` (E2B/E4B assistants) dropped;
* no K/V tensors (the assistant reads the target's KV cache) and no output head (the loader ties it to
  token_embd), so a checkpoint with them is refused rather than written for a loader that rejects it.

It is a drafter: ``convert_assistant`` takes the target dir only for the pair rules (the vocabulary written
is the assistant's own, as b11434's converter takes no ``--target-model-dir`` for it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from gguf import Keys, LlamaFileType

from ... import drafters
from ... import provenance as prov
from ...convert.configs import TargetFacts
from ...convert.result import ConvertResult, finish, target_record
from ...convert.targets import build_plan, family_for
from ...convert.targets.gemma4 import TENSOR_MAP, Gemma4Family
from ...errors import UnsupportedModelError
from ...ggufio import GGUFPlan
from ...hf_configs import read_config
from ..findings import Interpretation
from . import rules

ASSISTANT_TENSORS = {"pre_projection": "nextn.pre_projection", "post_projection": "nextn.post_projection"}


class Gemma4AssistantFamily(Gemma4Family):
    gguf_arch = rules.GGUF_ARCH
    tensor_map = {**TENSOR_MAP, **ASSISTANT_TENSORS}

    def check_config(self) -> None:
        """The assistant's own rules (the drafter family's, so precheck agrees), then every Gemma-4 one."""
        rules.interpret(self.src.config.raw, self.src.config.path).require()
        super().check_config()
        if self.is_moe():
            raise UnsupportedModelError(f"{self.src.config.path}: enable_moe_block is set; llama.cpp b11434's "
                                        "Gemma-4 assistant loader has no expert tensors. " + rules.PUBLISHED)

    def skip(self, hf_name: str) -> bool:
        return "masked_embedding" in hf_name or super().skip(hf_name)  # Gemma4AssistantModel.filter_tensors

    def backbone(self) -> int:
        return int(self.hp["backbone_hidden_size"])

    def expected_shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """Gemma-4's shapes minus K/V, output and per-layer-embedding tensors, plus the two projections
        (llama_model_gemma4_assistant::load_arch_tensors creates exactly these)."""
        required, _ = super().expected_shapes()
        h, bb = int(self.hp["hidden_size"]), self.backbone()
        dropped = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight", "inp_gate.weight", "proj.weight",
                   "post_norm.weight")
        required = {n: s for n, s in required.items() if not n.endswith(dropped) and not n.startswith("per_layer_")}
        required["nextn.pre_projection.weight"] = (h, 2 * bb)
        required["nextn.post_projection.weight"] = (bb, h)
        for i in range(self.block_count):
            required[f"blk.{i}.layer_output_scale.weight"] = (1,)  # required by the loader (flag 0)
        return required, {}

    def add_hparams(self, plan: GGUFPlan, ftype: LlamaFileType) -> None:
        """Gemma4Model.set_gguf_parameters, then Gemma4AssistantModel's two keys."""
        super().add_hparams(plan, ftype)
        plan.add_uint32(self.key(Keys.LLM.EMBEDDING_LENGTH_OUT), self.backbone())
        plan.add_uint32(self.key(Keys.LLM.NEXTN_PREDICT_LAYERS), self.block_count)



def convert(reading: Interpretation[rules.AssistantSpec], drafter_dir: Path, target_dir: Path, outfile: Path,
            outtype: str = "auto", *, tokenizer_dir: Path | None = None, provenance: dict[str, str] | None = None,
            quant: str | None = None, dry_run: bool = False,
            on_progress: Callable[[int, int], None] | None = None) -> ConvertResult:
    """Convert a Gemma-4 assistant into the GGUF b11434's ``convert_hf_to_gguf.py ASSISTANT`` writes.

    ``target_dir`` (its tokenizer read from ``tokenizer_dir`` when given) is checked against the assistant by
    the pair rules; nothing of it is written but our provenance keys.

    Raises:
        ConfigError, UnsupportedModelError, IncompatiblePairError, TensorError, TokenizerError, InputError,
        OutputError: each one paragraph naming the file, the field and the fix; nothing is written.
    """
    start = time.perf_counter()
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    spec: rules.AssistantSpec = reading.require()
    target_path = target_dir / "config.json"
    facts = TargetFacts.from_config(read_config(target_path, "Target config"), target_path)
    pair = rules.pair_findings(spec, facts)
    if tokenizer_dir is not None:  # a repaired overlay stands in for the target's tokenizer files
        pair = (*(f for f in pair if f.id != "pair.assistant_tokenizer"),
                *rules.tokenizer_findings(spec, Path(tokenizer_dir)))
    rules.require_tokenizer(spec)
    drafters.first_error(pair)
    fam = family_for(drafter_dir, drafter_dir, cls=Gemma4AssistantFamily)
    plan, vocab, outtype = build_plan(fam, outtype, (provenance or {}).get(prov.DRAFTER_REPO) or drafter_dir.name)
    recorded = target_record(target_dir, target_path, facts.arch or "?", vocab.sha256,
                             {prov.DRAFTER_SOURCE: prov.folder_label(drafter_dir), **(provenance or {})})
    return finish(plan, Path(outfile), outtype, vocab, (*reading.notes, *fam.notes), recorded, start, quant=quant,
                  dry_run=dry_run, on_progress=on_progress)
