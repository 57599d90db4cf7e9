"""Embeddings: pooling a prompt's hidden states into one vector (``pooling``)."""
