"""tokenizer.model synthesis from tokenizer.json, id-by-id donor checks, and the overlay dir.

Why: Gemma-4 ships no tokenizer.model, and the usual workaround (Gemma-3's file) maps other strings
to the chat ids. See ``repair.fix_tokenizer`` for the stage.
"""

from .compare import PieceDiff, diff_pieces, load_model_pieces
from .repair import FixResult, fix_tokenizer, overlay_provenance, resolve_donor, write_overlay
from .synthesize import TokenizerJsonVocab, read_tokenizer_json, synthesize_tokenizer_model, tokenizer_json_pieces

__all__ = ["FixResult", "PieceDiff", "TokenizerJsonVocab", "diff_pieces", "fix_tokenizer", "load_model_pieces",
           "overlay_provenance", "read_tokenizer_json", "resolve_donor", "synthesize_tokenizer_model",
           "tokenizer_json_pieces",
           "write_overlay"]
