"""The packed sort of the blame's start/end events (analysis.metrics.bubbles._event_order) equals
numpy's four-key lexsort, ties and the too-wide fallback included."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.metrics.bubbles import _event_order


@pytest.mark.parametrize("t_span", [50, 10**12, 2**61])  # 2**61: too wide to pack, lexsort
def test_event_order_is_the_lexsort(t_span: int) -> None:
    rng = np.random.default_rng(7)
    n = 5000
    track = rng.integers(-3, 9, n)
    t = rng.integers(0, t_span, n, dtype=np.int64)  # a span of 50: many equal times
    start = rng.integers(0, 2, n)
    depth = rng.integers(-6, 7, n)
    got = _event_order(track, t, start, depth)
    np.testing.assert_array_equal(got, np.lexsort((depth, start, t, track)))
