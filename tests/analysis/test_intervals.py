"""Interval algebra against a brute-force integer-grid reference (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis import intervals as iv

GRID = 60
spans = st.lists(st.tuples(st.integers(0, GRID), st.integers(0, GRID)), max_size=12)


def _arr(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    s = np.array([min(a, b) for a, b in pairs], dtype=np.int64)
    e = np.array([max(a, b) for a, b in pairs], dtype=np.int64)
    return s, e


def _mask(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    m = np.zeros(GRID + 1, dtype=bool)
    for a, b in zip(s.tolist(), e.tolist(), strict=False):
        m[a:b] = True
    return m


@settings(max_examples=200, deadline=None)
@given(spans)
def test_union_matches_grid(pairs: list[tuple[int, int]]) -> None:
    s, e = _arr(pairs)
    us, ue = iv.union(s, e)
    assert np.array_equal(_mask(us, ue), _mask(s, e))
    assert np.all(us[1:] > ue[:-1])  # disjoint and non-touching
    assert iv.measure((us, ue)) == _mask(s, e).sum()


@settings(max_examples=200, deadline=None)
@given(spans, spans)
def test_intersect_and_measure_match_grid(
    a: list[tuple[int, int]], b: list[tuple[int, int]]
) -> None:
    a_s, a_e = _arr(a)
    u = iv.union(*_arr(b))
    ref = _mask(*u)
    inter = iv.intersect(iv.union(a_s, a_e), u)
    assert np.array_equal(_mask(*inter), _mask(a_s, a_e) & ref)
    each = iv.intersect_measure(a_s, a_e, u)
    assert each.tolist() == [
        int(ref[x:y].sum()) for x, y in zip(a_s.tolist(), a_e.tolist(), strict=False)
    ]


@settings(max_examples=200, deadline=None)
@given(spans, st.integers(0, GRID), st.integers(0, GRID))
def test_complement_matches_grid(pairs: list[tuple[int, int]], lo: int, hi: int) -> None:
    lo, hi = min(lo, hi), max(lo, hi)
    u = iv.union(*_arr(pairs))
    gaps = iv.complement(u, lo, hi)
    window = np.zeros(GRID + 1, dtype=bool)
    window[lo:hi] = True
    assert np.array_equal(_mask(*gaps), window & ~_mask(*u))
    assert np.all(gaps[0][1:] > gaps[1][:-1])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, GRID), st.integers(0, GRID)), max_size=15)
)
def test_union_grouped_matches_per_group_union(rows: list[tuple[int, int, int]]) -> None:
    g = np.array([r[0] for r in rows], dtype=np.int64)
    s, e = _arr([(r[1], r[2]) for r in rows])
    og, os_, oe = iv.union_grouped(g, s, e)
    for group in range(4):
        sel = og == group
        ref = iv.union(s[g == group], e[g == group])
        assert np.array_equal(os_[sel], ref[0]) and np.array_equal(oe[sel], ref[1])


@settings(max_examples=150, deadline=None)
@given(spans, st.lists(st.integers(-5, GRID + 5), max_size=10))
def test_assign_finds_containing_interval(pairs: list[tuple[int, int]], ts: list[int]) -> None:
    us, ue = iv.union(*_arr(pairs))
    got = iv.assign(np.array(ts, dtype=np.int64), us, ue)
    for t, k in zip(ts, got.tolist(), strict=False):
        inside = [
            i for i, (a, b) in enumerate(zip(us.tolist(), ue.tolist(), strict=False)) if a <= t < b
        ]
        assert k == (inside[0] if inside else -1)
