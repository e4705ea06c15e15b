"""stepscope package."""
