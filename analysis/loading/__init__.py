"""Loading: trace files (stepscope/Perfetto protobuf, Kineto JSON) into typed frames
(``analysis.frames.TraceFrames``), with the name profiles that map other engines' slices onto
the contract's names (docs/design.md §4, §6). ``analysis.loading.load.load_trace`` is the entry."""
