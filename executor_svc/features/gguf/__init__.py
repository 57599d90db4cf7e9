"""Quantized weights from GGUF files: the reader, the side directory of HF files, the weights."""
