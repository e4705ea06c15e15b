"""Metrics: DataFrame in, DataFrame out, one concept per module (docs/design.md §5): the
measured window, overlap, bubbles and blame, waits, grammar, decisions, syncs, latency, steps
and phases, CPU lead and starvation, kernels and sampled runs."""
