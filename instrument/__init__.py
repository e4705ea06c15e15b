"""instrument package."""
