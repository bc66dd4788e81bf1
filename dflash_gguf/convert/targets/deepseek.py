"""DeepSeek-V2/V3/V3.2/V4 targets and the classes b11434 converts to their graphs (GLM-4.7-Flash, Kimi-K2.x).

z-lab publishes DFlash drafters for Kimi-K2.6, but b11434's deepseek2.cpp and deepseek32.cpp never set
t_layer_inp, so llm_graph_result::set_outputs asserts on the first draft. Their MTP draft graphs do run;
b11434's converter keeps the nextn layers (unless --no-mtp) except in DeepseekV2Model, whose skip_mtp drops them
("remove this when we support MTP for deepseek models"). DeepSeek-V4 targets are FP8 (not converted here).
"""

from __future__ import annotations

from ..configs import TargetArch

# The classes DeepseekV2Model converts without their nextn layers (its skip_mtp)
_NEXTN_DROPPED = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiVLForConditionalGeneration",
                  "KimiK25ForConditionalGeneration")
ARCHS = (
    TargetArch("deepseek2", (*_NEXTN_DROPPED, "Glm4MoeLiteForCausalLM"), False, graph="deepseek2.cpp", mtp_graph=True,
               mtp_dropped=_NEXTN_DROPPED),
    TargetArch("deepseek32", ("DeepseekV32ForCausalLM",), False, graph="deepseek32.cpp", mtp_graph=True),
    TargetArch("deepseek4", graph="deepseek4.cpp", mtp_graph=True, output_tap=True),
)
