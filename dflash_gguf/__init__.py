"""dflash-gguf: DFlash drafter + target from Hugging Face to a llama.cpp GGUF pair."""

__version__ = "0.1.0"

# The llama.cpp build whose converter, loader and quantizer this package matches byte for byte.
LLAMA_CPP_BUILD = "b11434"
