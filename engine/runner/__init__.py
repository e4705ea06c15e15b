"""engine/runner package."""
