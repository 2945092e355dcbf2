"""Model definitions, their registry, and checkpoint loading (HF folders and GGUF)."""
