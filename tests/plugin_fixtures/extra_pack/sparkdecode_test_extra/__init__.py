"""A test pack: one attention-boundary provider for short contexts."""
