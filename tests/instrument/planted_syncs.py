"""Planted host<-device syncs for the detector and lint tests (line numbers are asserted)."""

import torch

from instrument.lint import hot


# stepscope: hot
def hot_with_syncs(t: torch.Tensor) -> list:
    a = t.sum().item()  # line 10: .item()
    b = t.tolist()  # line 11: .tolist()
    c = t.cpu()  # line 12: .cpu()
    d = t.to("cpu")  # line 13: .to("cpu")
    if (t > 0).any():  # line 14: .any() as a condition
        pass
    e = bool(t.sum())  # line 16: bool()
    f = t.numpy()  # line 17: .numpy()
    return [a, b, c, d, e, f]


@hot
def hot_decorated(t: torch.Tensor) -> None:
    torch.cuda.synchronize()  # line 23
    t.sum().item()  # stepscope: allow-sync


def cold(t: torch.Tensor) -> float:
    return t.sum().item()  # not hot: never reported
