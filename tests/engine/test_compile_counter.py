"""The Triton compile counter (engine/kernels/compile_counter.py): installs, counts, chains, restores."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.kernels.compile_counter import CompileCounter

knobs = pytest.importorskip("triton.knobs")


def test_counts_chains_and_restores() -> None:
    seen: list[str] = []

    def previous(**kwargs: object) -> bool:
        seen.append(str(kwargs["repr"]))
        return False

    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = previous
    try:
        counter = CompileCounter()
        assert counter.install() and counter.counted
        hook = knobs.runtime.jit_cache_hook
        assert hook is not previous
        # what triton's JITFunction._call_hook passes (keywords)
        assert hook(key=1, repr="k[...]", fn=SimpleNamespace(name="_rms_norm_kernel")) is False
        assert hook(key=2, repr="k2[...]", fn=SimpleNamespace(name="_write_kv_kernel")) is False
        assert counter.names == ["_rms_norm_kernel", "_write_kv_kernel"]
        assert seen == ["k[...]", "k2[...]"]  # the hook installed before still runs
        counter.uninstall()
        assert knobs.runtime.jit_cache_hook is previous
        assert counter.count == 2 and counter.counted
    finally:
        knobs.runtime.jit_cache_hook = old
