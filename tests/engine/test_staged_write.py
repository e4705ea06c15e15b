"""StagedWriteTensor on the CPU device: diffs land where they should; the ring never rewrites a
staging buffer that a pending copy still reads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from engine.device import CpuDevice
from engine.kernels.staged_write import apply_staged_writes_torch
from engine.runner.staged_write import StagedWriteTensor


@pytest.fixture
def device():
    dev = CpuDevice()
    yield dev
    dev.close()


def test_torch_reference_matches_numpy() -> None:
    base = torch.zeros(4, 10, dtype=torch.int32)
    # writes: row 2 [3, 6) = 7 8 9 ; row 0 [0, 1) = 5 ; row 3 [8, 10) = 1 2
    rows = torch.tensor([2, 0, 3], dtype=torch.int32)
    starts = torch.tensor([3, 0, 8], dtype=torch.int32)
    offsets = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    values = torch.tensor([7, 8, 9, 5, 1, 2, -99], dtype=torch.int32)
    apply_staged_writes_torch(base, rows, starts, offsets, values, num_values=6)
    expected = np.zeros((4, 10), np.int32)
    expected[2, 3:6] = [7, 8, 9]
    expected[0, 0] = 5
    expected[3, 8:10] = [1, 2]
    np.testing.assert_array_equal(base.numpy(), expected)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_random_flushes_match_a_host_mirror(device: CpuDevice, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    table = StagedWriteTensor(
        device, (8, 40), dtype, ring_depth=2, initial_max_writes=2, initial_max_values=8
    )
    mirror = np.zeros((8, 40), dtype=table.gpu.numpy().dtype)
    for _ in range(30):
        for row in rng.choice(8, size=rng.integers(0, 6), replace=False):
            start = int(rng.integers(0, 40))
            vals = rng.integers(-1000, 1000, size=int(rng.integers(1, 41 - start)))
            table.stage(int(row), start, vals)
            mirror[row, start : start + len(vals)] = vals
        table.apply(table.flush())
    device.synchronize()
    np.testing.assert_array_equal(table.gpu.numpy(), mirror)


def test_stage_validates_bounds_and_overlap(device: CpuDevice) -> None:
    table = StagedWriteTensor(device, (2, 4), torch.int32)
    with pytest.raises(IndexError):
        table.stage(2, 0, [1])
    with pytest.raises(IndexError):
        table.stage(0, 3, [1, 2])
    table.stage(0, 0, [1, 2])
    with pytest.raises(ValueError, match="overlapping"):
        table.stage(0, 1, [3])
    table.stage(0, 2, [3, 4])  # adjacent is fine
    with pytest.raises(ValueError):
        StagedWriteTensor(device, (2, 4), torch.int32, ring_depth=1)


def test_ring_waits_for_the_copy_that_reads_a_slot(device: CpuDevice) -> None:
    depth = 2
    table = StagedWriteTensor(device, (1, 8), torch.int64, ring_depth=depth)
    gate = threading.Event()
    device.submit(device.h2d_stream, gate.wait)  # hold every copy in flight
    for k in range(depth):
        table.stage(0, k, [100 + k])
        table.apply(table.flush())
    assert table.num_ring_stalls == 0

    # Slot 0 is still read by the held copy: packing into it again must block, not overwrite.
    table.stage(0, depth, [100 + depth])
    result: list[object] = []
    packer = threading.Thread(target=lambda: result.append(table.flush()))
    packer.start()
    time.sleep(0.05)
    assert packer.is_alive() and not result
    gate.set()
    packer.join(timeout=5)
    assert result and table.num_ring_stalls == 1
    table.apply(result[0])  # type: ignore[arg-type]
    device.synchronize()
    assert table.gpu[0, : depth + 1].tolist() == [100 + k for k in range(depth + 1)]


def test_flush_refuses_to_reuse_an_unapplied_slot(device: CpuDevice) -> None:
    table = StagedWriteTensor(device, (1, 4), torch.int32, ring_depth=2)
    for k in range(2):
        table.stage(0, k, [k])
        table.flush()  # never applied
    table.stage(0, 2, [2])
    with pytest.raises(RuntimeError, match="before its flush was applied"):
        table.flush()


def test_empty_flush_is_none_and_apply_none_is_noop(device: CpuDevice) -> None:
    table = StagedWriteTensor(device, (2, 2), torch.int32, fill=-1)
    assert table.flush() is None
    table.apply(None)
    device.synchronize()
    assert table.gpu.tolist() == [[-1, -1], [-1, -1]]


def test_pack_enqueues_no_copy_until_copy(device: CpuDevice) -> None:
    """``pack`` is host work only (the runner packs before its h2d stage opens): nothing reaches
    the h2d stream until ``copy``, and pack + copy + apply write what flush + apply write."""
    table = StagedWriteTensor(device, (2, 8), torch.int32, ring_depth=2)
    table.stage(0, 1, [7, 8, 9])
    table.stage(1, 0, [5])
    recorded: list[object] = []
    original = device.submit

    def submit(stream: object, fn: object) -> None:
        recorded.append(stream)
        original(stream, fn)  # type: ignore[arg-type]

    device.submit = submit  # type: ignore[method-assign]
    try:
        packed = table.pack()
        assert packed is not None and packed.num_writes == 2 and recorded == []
        assert table.num_pending == 0  # the writes are in the slot now
        assert table.copy(packed) is packed and recorded == [device.h2d_stream]
    finally:
        device.submit = original  # type: ignore[method-assign]
    table.apply(packed)
    assert table.copy(table.pack()) is None  # nothing staged: nothing packed or copied
    device.synchronize()
    assert table.gpu.tolist() == [[0, 7, 8, 9, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0, 0, 0]]
