"""Tensor parallelism through ``torch.distributed`` (``--tensor-parallel-size N``).

* :mod:`engine.distributed.parallel_state` -- process groups (NCCL/gloo), collectives, clock sync;
* :mod:`engine.distributed.parallel_linear` -- column/row-parallel linears, vocab-parallel
  embedding and LM head, and the shard rules the loader uses;
* :mod:`engine.distributed.rank_context` -- what one rank builds (its device, its shard);
* :mod:`engine.distributed.executor` -- rank 0: spawns the other ranks, broadcasts each step;
* :mod:`engine.distributed.worker` -- ranks 1..N-1: run their runner on each broadcast step.

Nothing is imported here, so ``engine.model`` can import the layers without a cycle.
"""

__all__: list[str] = []
