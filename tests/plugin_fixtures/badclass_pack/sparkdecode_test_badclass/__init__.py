"""A test pack whose hook returns a class for a block that does not exist."""
