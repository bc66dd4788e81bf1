"""Qwen3 dense targets, as b11434's ``Qwen3Model`` (conversion/qwen.py, via ``Qwen2Model``) writes them.

b11434 reads the config through transformers' ``Qwen3Config`` (defaults filled in, see
``qwen3_hparams`` below) and writes ``TextModel``'s generic keys only. Tensors map one to one;
``lm_head`` is absent when the embeddings are tied. The vocabulary takes the GPT-2 BPE path (or the
SentencePiece one when a ``tokenizer.model`` is present), exactly as for a Qwen3 drafter's target.
Rerankers and sentence-transformers exports (extra pooling/classifier keys) are refused.
"""

from __future__ import annotations

from typing import Any

from ...errors import UnsupportedModelError
from ...tensor_names import DECODER_BLOCK, QK_NORM, TEXT_MODEL, block_map
from ..configs import TargetArch
from .base import TextFamily, attention_shapes

# transformers 4.57.6 Qwen3Config.__init__ defaults (models/qwen3/configuration_qwen3.py).
QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
}


def qwen3_hparams(raw: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3 config.json as transformers 4.57.6's ``Qwen3Config(...).to_dict()`` gives it to b11434."""
    hp = {**QWEN3_DEFAULTS, **raw}
    if raw.get("num_key_value_heads") is None:
        hp["num_key_value_heads"] = hp["num_attention_heads"]
    if not hp.get("use_sliding_window"):
        hp["sliding_window"] = None
    if hp.get("layer_types") is None:
        hp["layer_types"] = [
            "sliding_attention" if hp["sliding_window"] is not None and i >= hp["max_window_layers"]
            else "full_attention" for i in range(hp["num_hidden_layers"])
        ]
    if isinstance(hp.get("rope_scaling"), dict) and "type" in hp["rope_scaling"]:
        hp["rope_scaling"] = {**hp["rope_scaling"], "rope_type": hp["rope_scaling"]["type"]}
    return hp


ARCH = TargetArch("qwen3", ("Qwen3ForCausalLM",), True, "sentencepiece-or-gpt2", graph="qwen3.cpp")
ARCHS = (ARCH,)

# HF name -> GGUF name; b11434 gguf-py tensor_mapping.py entries used by MODEL_ARCH.QWEN3.
TENSOR_MAP = {**TEXT_MODEL, **block_map(DECODER_BLOCK | QK_NORM)}


class Qwen3Family(TextFamily):
    gguf_arch = ARCH.gguf
    tensor_map = TENSOR_MAP

    @classmethod
    def load_hparams(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return qwen3_hparams(raw)

    def check_config(self) -> None:
        path, src = self.src.config.path, self.src
        if self.hp.get("attention_bias"):
            raise UnsupportedModelError(f"{path}: attention_bias is true; llama.cpp b11434's Qwen3 loader has no "
                                        "attention bias tensors. Convert it with llama.cpp's converter (--llama-cpp "
                                        "DIR) to see how it handles them, or pass --target-gguf.")
        readme = src.model_dir / "README.md"
        card = readme.read_text(encoding="utf-8", errors="replace").lower() if readme.is_file() else ""
        hints = (src.model_dir.name + " " + str(self.hp.get("_name_or_path", ""))).lower()
        if "# qwen3-reranker" in card or "qwen3-reranker" in hints or (src.model_dir / "modules.json").is_file():
            raise UnsupportedModelError(
                f"{src.model_dir}: a Qwen3 reranker or sentence-transformers export (README / folder name / "
                "modules.json). llama.cpp b11434 writes extra pooling and classifier keys for those, which the "
                "built-in converter does not; and a DFlash target is a plain causal LM. Use llama.cpp's converter "
                "(--llama-cpp DIR) for it.")

    def expected_shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        hp = self.hp
        h, v, nh = int(hp["hidden_size"]), int(hp["vocab_size"]), int(hp["num_attention_heads"])
        kv, hd, ff = int(hp["num_key_value_heads"]), int(hp["head_dim"]), int(hp["intermediate_size"])
        required: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
        optional: dict[str, tuple[int, ...]] = {"output.weight": (v, h)}
        for i in range(self.block_count):
            b = f"blk.{i}."
            required.update(attention_shapes(b, h, nh, kv, hd, hd, hd))
            required.update({b + "ffn_gate.weight": (ff, h), b + "ffn_up.weight": (ff, h),
                             b + "ffn_down.weight": (h, ff)})
        if not hp.get("tie_word_embeddings", False):
            required["output.weight"] = optional.pop("output.weight")
        return required, optional


FAMILY = Qwen3Family
