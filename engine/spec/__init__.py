"""engine/spec package."""
