"""GGUF sources (llama.cpp's single-file checkpoints): the container, its metadata and its tensors."""
