"""Model folders: the tiny model built locally, a user's folder checked, GGUF files turned into Hugging Face folders."""
