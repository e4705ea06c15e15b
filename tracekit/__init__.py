"""Trace-building kit shared by the tests and the benchmarks (docs/design.md §8): traces with
exact, hand-chosen timestamps written by producers other than the engine.

- ``tracekit.perfetto``: Perfetto TrackEvent packets from a ``TraceSpec`` (optionally interned);
- ``tracekit.kineto``: torch.profiler Chrome-JSON events (``X`` events, correlation ids);
- ``tracekit.engine_loop``: a simulated engine loop written through the real ``Tracer``;
- ``tracekit.browser``: the headless Chromium the browser tests and bench_dashboard drive.

Not part of the installed package; tests and ``bench/`` import it from the repository root.
"""
