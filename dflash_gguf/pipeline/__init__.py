"""The pipeline: two sources (Hub repos or folders) to a verified, quantized DFlash GGUF pair + pair.json.

Stages are plain functions (``stages``); ``run.run_pipeline`` runs them in order and skips what
``pair.json`` (``manifest``) vouches for; ``options`` holds what a run is asked for and settles it before anything
is fetched; ``plan`` sizes the run before any weight is fetched.
"""

from .manifest import MANIFEST_NAME, Manifest, read_manifest
from .options import PipelineOptions
from .plan import Plan
from .run import PipelineResult, run_pipeline

__all__ = ["MANIFEST_NAME", "Manifest", "PipelineOptions", "PipelineResult", "Plan",
           "read_manifest", "run_pipeline"]
