"""Building blocks models share: the pre-norm `transformer` block with packing and the KV cache, the
cross-attention `decoder` for sequence-to-sequence models, and the Llama-style `layers` (rotary embeddings
with Llama 3 scaling, RMSNorm, SwiGLU)."""
