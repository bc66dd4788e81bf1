"""The pipeline: two sources (Hub repos or folders) to a verified, quantized DFlash GGUF pair + pair.json.

Stages are plain functions (``stages``); ``run.run_pipeline`` runs them in order and skips what
``pair.json`` (``manifest``) vouches for; ``plan`` sizes the run before any weight is fetched.
"""

from .manifest import MANIFEST_NAME, Manifest, read_manifest
from .plan import Plan
from .run import PipelineOptions, PipelineResult, run_pipeline

__all__ = ["MANIFEST_NAME", "Manifest", "PipelineOptions", "PipelineResult", "Plan",
           "read_manifest", "run_pipeline"]
