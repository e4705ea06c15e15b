"""engine/model package."""
