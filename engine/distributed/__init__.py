"""Tensor-parallel building blocks under the model (``--tensor-parallel-size N``).

* :mod:`engine.distributed.parallel_state` -- process groups (NCCL/gloo), collectives, clock sync;
* :mod:`engine.distributed.parallel_linear` -- column/row-parallel linears, vocab-parallel
  embedding and LM head, and the shard rules the loader uses.

The ranks themselves (what one rank builds, rank 0's driver, the workers) live one floor up in
:mod:`engine.executor`. This package imports nothing of the engine above it (docs/design.md §1.2).
"""

__all__: list[str] = []
