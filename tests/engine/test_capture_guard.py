"""The CPU check of CUDA-graph bodies (engine.runner.capture_guard): every classic way a body
copies host data to the device, or reads a device value on the host, is caught and located;
device-only work passes. Each bad body is one a CUDA capture rejects ("Cannot copy between CPU
and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned", or a sync)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from engine.device import CpuDevice
from engine.runner.capture_guard import HostDataGuard, device_tensors
from engine.runner.spec_graphs import capture_failure
from engine.runner.staged_write import StagedWriteTensor
from engine.spec.graph_step import StepBuffers

X = torch.arange(8)  # a device buffer (registered below)
IDX = torch.tensor([1, 3])  # a device index tensor (registered below)
CPU_CONST = torch.arange(4)  # a tensor a module kept on the host: not registered


def _guard(fn) -> HostDataGuard:
    with HostDataGuard([X, IDX]) as guard:
        fn()
    return guard


def _list_index() -> None:
    X[[0, 1]]


def _scalar_setitem() -> None:
    X.clone()[2] = 7  # cu[bp + 1] = n: a 0-dim host tensor copied into the device


def _tensor_of_list() -> None:
    X[:2] + torch.tensor([1, 2])


def _host_scalar_tensor() -> None:
    X + torch.tensor(3)


def _from_numpy() -> None:
    X[:3] * torch.from_numpy(np.arange(3))


def _unregistered_tensor() -> None:
    X[:4] + CPU_CONST


def _item() -> None:
    int(X.sum())


def _mask_index() -> None:
    X[X > 3]


def _where_one_arg() -> None:
    torch.where(X > 3)


@pytest.mark.parametrize(
    "body, why",
    [
        (_list_index, "host tensor"),
        (_scalar_setitem, "host tensor"),
        (_tensor_of_list, "host tensor"),
        (_host_scalar_tensor, "host tensor"),
        (_from_numpy, "host tensor"),
        (_unregistered_tensor, "no device buffer"),
        (_item, "device value on the host"),
        (_mask_index, "device value on the host"),
        (_where_one_arg, "device value on the host"),
    ],
)
def test_host_data_in_a_body_is_caught_at_its_line(body, why) -> None:
    guard = _guard(body)
    assert len(guard.violations) >= 1
    first = guard.violations[0]
    assert why in first.why
    lines, start = inspect.getsourcelines(body)
    line = start + len(lines) - 1  # each body is one line
    assert first.where.startswith(f"tests/engine/test_capture_guard.py:{line} ({body.__name__})")


def test_device_only_work_passes() -> None:
    def body() -> None:
        y = X * 2 + 1
        y[1:3] = 5  # fill_ with a host scalar: no copy
        z = torch.where(y > 4, y, 0).clamp(max=6)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(z, 0)])
        cu = torch.cat([cu, torch.full_like(cu[:1], 9)])
        req = torch.searchsorted(cu[1:], torch.arange(8), right=True)
        one_hot = torch.nn.functional.one_hot(X[IDX], 8)  # the CPU version calls .item()
        y[IDX] = z[IDX]
        torch.full_like(X, 4)[req.clamp(max=7)] + one_hot.sum(0)

    guard = _guard(body)
    assert guard.violations == [] and guard.num_ops > 10


def test_host_buffers_are_never_device_buffers() -> None:
    """A staged-write tensor's device side is walked, its host staging buffers are not; a
    buffer of ``Device.host_empty`` is host even where a walk listed it."""
    staged = StagedWriteTensor(CpuDevice(), (4, 3), torch.int64)
    bufs = StepBuffers(*(torch.zeros(4, dtype=torch.int64) for _ in range(6)))
    found = {id(t) for t in device_tensors(staged, bufs)}
    slot = staged._slots[0]
    assert id(staged.gpu) in found and id(slot.dev_meta) in found
    assert id(slot.host_meta) not in found and id(slot.host_values) not in found
    assert all(id(getattr(bufs, name)) in found for name in ("input_ids", "packed"))
    with HostDataGuard([staged.gpu, slot.host_meta], host=[slot.host_meta]) as guard:
        staged.gpu[0, :2].copy_(slot.host_meta[:2])  # an h2d copy from a (pinned) host buffer
    assert guard.violations and all("host tensor" in v.why for v in guard.violations)


def test_capture_failure_names_the_line_that_raised() -> None:
    def layout() -> None:
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture\nx")

    try:
        layout()
    except RuntimeError as exc:
        reason = capture_failure(exc)
    line = inspect.getsourcelines(layout)[1] + 1
    assert reason.startswith("capture failed: RuntimeError: Cannot copy between CPU and CUDA")
    assert f"[at tests/engine/test_capture_guard.py:{line} (layout) <- " in reason
    assert "\n" not in reason
