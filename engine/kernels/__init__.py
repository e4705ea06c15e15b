"""Kernel families: each file holds a torch reference, its Triton version and a dispatcher."""

__all__: list[str] = []
