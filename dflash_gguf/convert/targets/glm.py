"""GLM-4.5/4.6, GLM-5.1 and GLM-5-Next targets.

z-lab publishes DFlash drafters for GLM-5.1, but b11434's GLM graphs never set t_layer_inp, so
llm_graph_result::set_outputs asserts on the first draft; their MTP draft graphs do run, and b11434's converter
keeps the nextn layers (unless --no-mtp).
"""

from __future__ import annotations

from ..configs import TargetArch

ARCHS = (
    TargetArch("glm4moe", ("Glm4MoeForCausalLM", "Glm4vMoeForConditionalGeneration", "SolarOpenForCausalLM"), False,
               graph="glm4-moe.cpp", mtp_graph=True),
    TargetArch("glm-dsa", ("GlmMoeDsaForCausalLM",), False, graph="glm-dsa.cpp", mtp_graph=True),
    TargetArch("glm5-next", ("Glm5NextForConditionalGeneration",), False, graph="glm5-next.cpp", mtp_graph=True),
)
