"""A test pack whose plug-in module cannot be imported."""
