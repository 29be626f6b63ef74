"""Model definitions, written against the paged-attention interface."""
