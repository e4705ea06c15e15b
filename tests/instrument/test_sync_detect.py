"""The runtime sync detector catches each planted pattern with the right file:line."""

from __future__ import annotations

import os

import pytest
import torch

from instrument.sync_detect import SyncDetector, hot_region
from instrument.tracer import Tracer
from tests.instrument import planted_syncs
from tests.instrument.conftest import read_trace

PLANTED = os.path.abspath(planted_syncs.__file__)


def test_cpu_patterns_in_hot_region(tmp_path):
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    t = torch.arange(4, dtype=torch.float32)
    with SyncDetector(tracer) as detector, hot_region():
        planted_syncs.hot_with_syncs(t)
    tracer.close()
    got = [(h.op, h.where) for h in detector.hits]
    expected_lines = {"item": 10, "tolist": 11, "cpu": 12, "to(cpu)": 13, "bool": 14}
    for op, line in expected_lines.items():
        assert (op, f"{PLANTED}:{line}") in got, (op, got)
    assert ("bool", f"{PLANTED}:16") in got
    assert all(h.hot for h in detector.hits)
    syncs = [e for e in read_trace(path).events if e.name == "sync"]
    assert len(syncs) == len(detector.hits)
    assert {"op", "where", "stack", "hot"} <= set(syncs[0].args)
    assert "hot_with_syncs" in syncs[0].args["stack"]


def test_cpu_tensors_outside_hot_region_are_not_syncs():
    t = torch.ones(3)
    with SyncDetector(Tracer(enabled=False)) as detector:
        planted_syncs.cold(t)
        t.tolist()
    assert detector.hits == []


def test_uninstall_restores_torch():
    original = torch.Tensor.item
    with SyncDetector(Tracer(enabled=False)):
        assert torch.Tensor.item is not original
        with pytest.raises(RuntimeError, match="already installed"):
            SyncDetector(Tracer(enabled=False)).install()
    assert torch.Tensor.item is original


@pytest.mark.gpu
def test_cuda_patterns():
    detector = SyncDetector(Tracer(enabled=False))
    x = torch.ones(8, device="cuda")
    pageable = torch.ones(8)
    with detector:
        x.sum().item()  # a device tensor: a sync even outside hot regions
        torch.cuda.synchronize()
        torch.cuda.Event().synchronize()
        torch.cuda.current_stream().synchronize()
        pageable.to("cuda", non_blocking=True)
        torch.nonzero(x)  # hidden sync, caught through torch's sync debug mode
    ops = [h.op for h in detector.hits]
    for op in (
        "item",
        "cuda.synchronize",
        "Event.synchronize",
        "Stream.synchronize",
        "non_blocking_pageable_copy",
        "cuda_sync_debug",
    ):
        assert op in ops, (op, ops)
    here = os.path.abspath(__file__)
    assert all(h.where.startswith(here) for h in detector.hits)
