"""A linear LM head: its geometry (layouts, GEMMs), its 16-bit backward, logits at given ids,
the vocabulary walked in chunks, a sampler's kept set, and equal row blocks."""
