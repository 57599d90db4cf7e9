"""Embeddings (pooled prompt-only requests): the Embed RPC's requests and their vectors."""
