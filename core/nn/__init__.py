"""Building blocks models share: the pre-norm `transformer` block with packing and the KV cache, and the
cross-attention `decoder` for sequence-to-sequence models."""
