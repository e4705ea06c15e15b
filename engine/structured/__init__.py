"""engine/structured package."""
