"""Qwen3-MoE targets (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B), as b11434's ``Qwen3MoeModel``
(conversion/qwen.py, via ``Qwen2MoeModel``) writes them.

Keys: b11434 reads the config through transformers' ``Qwen3MoeConfig`` (``qwen3moe_hparams`` below) and
writes ``TextModel.set_gguf_parameters``' generic keys (``expert_count`` from num_experts and
``expert_used_count`` from num_experts_per_tok among them; ``key_length``/``value_length`` only when config.json
has head_dim, which Qwen3MoeConfig does not default), then ``Qwen2MoeModel.set_gguf_parameters``'
``expert_feed_forward_length`` (moe_intermediate_size) and, were a config to carry one,
``expert_shared_feed_forward_length``. Nothing records norm_topk_prob, decoder_sparse_step or the router loss:
b11434's qwen3moe graph always renormalises the chosen experts' weights after a softmax.

Tensors: Qwen3's attention block (q/k norms included), ``ffn_norm``, the router ``mlp.gate`` -> ``ffn_gate_inp``
(F32 whatever the outtype, as ``ModelBase.prepare_tensors`` keeps it), and the experts (``experts.py``): one
tensor per expert, stacked into ``ffn_{down,gate,up}_exps`` where the layer's last expert tensor is read, or
fused 3-D tensors, split. No ``output`` when the embeddings are tied (no lm_head in the checkpoint).

Vocabulary: ``Qwen3MoeModel.set_vocab`` -> ``TextModel.set_vocab``: the GPT-2 BPE path whatever tokenizer files
sit beside it (Qwen3's class tries SentencePiece first; this one does not). Its InternS1 branch belongs to
another architecture (``InternS1ForConditionalGeneration``), not converted here.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from gguf import Keys, LlamaFileType

from ...errors import ConfigError, UnsupportedModelError
from ...ggufio import GGUFPlan
from ...tensor_names import DECODER_BLOCK, QK_NORM, QWEN_MOE_MLP, TEXT_MODEL, block_map
from ..configs import TargetArch
from .base import TensorSpec, TextFamily, add_text_hparams, attention_shapes, block_id
from .experts import (
    PER_EXPERT,
    ExpertStacks,
    check_config_fields,
    check_expert_counts,
    expert_shapes,
    split_gate_up,
)

# transformers 4.57.6 Qwen3MoeConfig.__init__ defaults (models/qwen3_moe/configuration_qwen3_moe.py). Unlike Qwen3Config
# it has no head_dim (the attention falls back to hidden_size // num_attention_heads, and b11434 then writes no
# key_length) and no layer_types; num_key_value_heads defaults to 4, not to the head count.
QWEN3MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
    "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None,
    "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096, "decoder_sparse_step": 1,
    "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
    "output_router_logits": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": None,
}


def qwen3moe_hparams(raw: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-MoE config.json as transformers 4.57.6's ``Qwen3MoeConfig(...).to_dict()`` gives it to b11434."""
    hp = {**QWEN3MOE_DEFAULTS, **raw}
    if not hp.get("use_sliding_window"):
        hp["sliding_window"] = None
    if hp.get("mlp_only_layers") is None:
        hp["mlp_only_layers"] = []
    if isinstance(hp.get("rope_scaling"), dict) and "type" in hp["rope_scaling"]:
        hp["rope_scaling"] = {**hp["rope_scaling"], "rope_type": hp["rope_scaling"]["type"]}
    return hp


ARCH = TargetArch("qwen3moe", ("Qwen3MoeForCausalLM",), True, "gpt2", (
    "llama.cpp b11434's converter cannot convert a DFlash drafter for a Qwen3-MoE target: Qwen3MoeModel.set_vocab "
    "calls super().set_vocab() on the drafter's converter object, which is no Qwen3MoeModel (TypeError). This "
    "file embeds what the GPT-2 path that call leads to (TextModel.set_vocab) writes."), graph="qwen3moe.cpp")
ARCHS = (ARCH,)

# Normalised HF name -> GGUF name; b11434 gguf-py tensor_mapping.py entries used by MODEL_ARCH.QWEN3MOE (no dense
# FFN, no shared expert). ``gate_up_exps`` is a planning name only: it is split before anything is written.
TENSOR_MAP = {
    **TEXT_MODEL,
    **block_map({k: v for k, v in DECODER_BLOCK.items() if not k.startswith("mlp.")} | QK_NORM),
    **block_map({k: QWEN_MOE_MLP[k] for k in ("mlp.gate", "mlp.experts.down_proj", "mlp.experts.gate_up_proj")}),
}
_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


class Qwen3MoeFamily(TextFamily):
    gguf_arch = ARCH.gguf
    tensor_map = TENSOR_MAP

    @classmethod
    def load_hparams(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return qwen3moe_hparams(raw)

    @property
    def n_experts(self) -> int:
        return int(self.hp["num_experts"])

    def head_dim(self) -> int:
        """Qwen3MoeAttention's ``getattr(config, "head_dim", hidden_size // num_attention_heads)``."""
        hd = self.hp.get("head_dim")
        return int(hd) if hd is not None else int(self.hp["hidden_size"]) // int(self.hp["num_attention_heads"])

    @cached_property
    def experts(self) -> ExpertStacks:
        """The checkpoint's one-tensor-per-expert weights (empty when its experts are fused)."""
        return ExpertStacks.index(self.src.tensors, self.normalise_name, self.n_experts, self.skip)

    def check_config(self) -> None:
        """Refuse what b11434's converter stops on or its qwen3moe loader cannot load, before any tensor is read."""
        path, hp = self.src.config.path, self.hp
        fallback = "Convert it with llama.cpp's converter (--llama-cpp DIR) or pass --target-gguf."
        if hp.get("attention_bias"):
            raise UnsupportedModelError(f"{path}: attention_bias is true; the Qwen3-MoE releases have no attention "
                                        f"biases and the built-in converter does not write them. {fallback}")
        check_config_fields(path, hp, ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                                       "num_experts", "num_experts_per_tok", "moe_intermediate_size"), "Qwen3-MoE")
        step = hp.get("decoder_sparse_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ConfigError(f"{path}: decoder_sparse_step is {step!r}; it must be a whole number of at least 1 "
                              "(1: every layer a mixture of experts). Use the config.json published with the model.")
        only = hp.get("mlp_only_layers") or []
        if not isinstance(only, list):
            raise ConfigError(f"{path}: mlp_only_layers is {only!r}; it must be a list of layer indices. Use the "
                              "config.json published with the model.")
        if dense := [i for i in range(self.block_count) if i in only or (i + 1) % step]:
            raise UnsupportedModelError(
                f"{path}: layer(s) {dense[:8]} have a dense MLP (decoder_sparse_step {step}, mlp_only_layers "
                f"{list(only)[:8]}). llama.cpp b11434's qwen3moe models every layer as a mixture of experts: its "
                "converter stops with 'Can not map tensor' on a dense layer's mlp.gate_proj and its loader has no "
                "dense FFN. Only checkpoints with decoder_sparse_step 1 and mlp_only_layers [] can be converted.")
        check_expert_counts(path, self.n_experts, int(hp["num_experts_per_tok"]), "num_experts")
        if not hp.get("norm_topk_prob"):
            self.notes.append("norm_topk_prob is false, but llama.cpp's qwen3moe graph always renormalises the "
                              "chosen experts' weights: outputs will differ from transformers'")

    # -- tensors --------------------------------------------------------------------------------
    def normalise_name(self, hf_name: str) -> str:
        """ModelBase.filter_tensors, and Qwen2MoeModel's ``.weight`` on the fused expert tensors."""
        name = super().normalise_name(hf_name)
        return name + ".weight" if name.endswith(_FUSED) else name

    def gguf_name(self, name: str) -> str | None:
        """One expert's own tensor gets a planning name (it becomes a slice of a stacked tensor)."""
        if PER_EXPERT.match(name):
            return self.experts.planning_name(name)
        return super().gguf_name(name)

    def modify(self, spec: TensorSpec, hf_name: str) -> list[TensorSpec]:
        """Qwen2MoeModel.modify_tensors: experts stacked (per-expert layout) or split (fused gate_up_proj)."""
        name = self.normalise_name(hf_name)
        if PER_EXPERT.match(name):
            return self.experts.stacked(hf_name, f"blk.{block_id(name)}.")
        if name.endswith(".mlp.experts.gate_up_proj.weight"):
            return split_gate_up(spec)
        return [spec]

    def force_f32(self, name: str) -> bool:
        return name.endswith(".ffn_gate_inp.weight")  # FFN_GATE_INP (ModelBase.prepare_tensors)

    def expected_shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        hp = self.hp
        h, v, nh = int(hp["hidden_size"]), int(hp["vocab_size"]), int(hp["num_attention_heads"])
        kv, hd = int(hp["num_key_value_heads"]), self.head_dim()
        e, mf = self.n_experts, int(hp["moe_intermediate_size"])
        required: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
        optional: dict[str, tuple[int, ...]] = {"output.weight": (v, h)}
        for i in range(self.block_count):
            b = f"blk.{i}."
            required.update({**attention_shapes(b, h, nh, kv, hd, hd, hd), b + "ffn_gate_inp.weight": (e, h)})
            if self.experts:
                required.update(expert_shapes(i, e, {"gate": (mf, h), "up": (mf, h), "down": (h, mf)}))
            else:
                required.update({b + "ffn_gate_up_exps.weight": (e, 2 * mf, h), b + "ffn_down_exps.weight": (e, h, mf)})
        if not hp.get("tie_word_embeddings", False):
            required["output.weight"] = optional.pop("output.weight")
        return required, optional

    # -- metadata -------------------------------------------------------------------------------
    def add_hparams(self, plan: GGUFPlan, ftype: LlamaFileType) -> None:
        """TextModel, then Qwen2MoeModel.set_gguf_parameters (Qwen3MoeModel adds nothing)."""
        add_text_hparams(self, plan, ftype)
        if (n := self.hp.get("moe_intermediate_size")) is not None:
            plan.add_uint32(self.key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), n)
        if (n := self.hp.get("shared_expert_intermediate_size")) is not None:
            plan.add_uint32(self.key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH), n)


FAMILY = Qwen3MoeFamily
