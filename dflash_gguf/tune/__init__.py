"""``tune``: measure every way llama-server can speculate for a target on this machine, and pick the fastest.

The engine (:mod:`.engine`: one server per configuration, the workload, the counters) is shared with ``forecast``;
the sweep over methods and n-max and the tune run are :mod:`.sweep`; the report and its verdict :mod:`.report`.
"""

from .engine import (
    METHODS,
    TargetInfo,
    TuneOptions,
    check_projector_file,
    check_target,
    inspect_drafter,
    measure_configurations,
    served_projector,
)
from .report import OWN_MTP_METHOD, Configuration, Drafter, Measurement, TagSpeed, TuneReport, fastest_tag
from .server import find_llama_server
from .sweep import (
    DEFAULT_N_MAX,
    TunePlan,
    applicable_methods,
    coarse_n_max,
    first_configurations,
    plan_tune,
    refine_n_max,
    tune,
)
from .workload import Workload

__all__ = ["DEFAULT_N_MAX", "METHODS", "OWN_MTP_METHOD", "Configuration", "Drafter", "Measurement",
           "TagSpeed", "TargetInfo", "TuneOptions", "TunePlan", "TuneReport", "Workload", "applicable_methods",
           "check_projector_file", "check_target", "coarse_n_max", "fastest_tag", "find_llama_server",
           "first_configurations", "inspect_drafter", "measure_configurations", "plan_tune", "refine_n_max",
           "served_projector", "tune"]
