"""Kernel families, the engine's ground floor: each file holds a torch reference and its Triton
version; :mod:`engine.kernels.backend` picks one implementation of every operation, once
(``create_kernel_backend``). Nothing here imports the engine above it (docs/design.md §1.2)."""

__all__: list[str] = []
