"""Running the tensor-parallel ranks (``--tensor-parallel-size N``).

* :mod:`engine.executor.rank_context` -- what one rank builds (its device, its shard);
* :mod:`engine.executor.tp_driver` -- rank 0: spawns the other ranks, broadcasts each step;
* :mod:`engine.executor.worker` -- ranks 1..N-1: build their runner through the same factory as
  ``EngineCore`` and run it on each broadcast step;
* :mod:`engine.executor.messages` -- the step messages rank 0 broadcasts.

Nothing is imported here.
"""

__all__: list[str] = []
