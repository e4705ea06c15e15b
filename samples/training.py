"""Training plumbing for the sample models: token data, batches, AdamW, cosine schedule, step budget.

Nothing here knows which model is trained; ``train_models.py`` composes it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from samples.corpus import is_val_file, list_stdlib_files, read_texts

__all__ = [
    "TokenData",
    "tokenize_corpus",
    "sample_batch",
    "val_windows",
    "make_optimizer",
    "cosine_lr",
    "StepBudget",
]


@dataclass(frozen=True)
class TokenData:
    """The corpus as two flat int64 token streams (files joined by EOS)."""

    train: torch.Tensor  # [num_train_tokens] int64
    val: torch.Tensor  # [num_val_tokens] int64
    num_train_files: int
    num_val_files: int


def tokenize_corpus(
    tokenizer_file: Path, eos_id: int, val_percent: int, max_files: int | None = None
) -> TokenData:
    """Tokenize every stdlib ``.py`` file (tests included), each followed by ``eos_id``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    files = list(read_texts(list_stdlib_files(include_tests=True)))
    if max_files is not None:
        files = files[:max_files]
    encodings = tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    train_ids: list[int] = []
    val_ids: list[int] = []
    num_val = 0
    for corpus_file, encoding in zip(files, encodings, strict=True):
        is_val = is_val_file(corpus_file.rel_path, val_percent)
        num_val += is_val
        (val_ids if is_val else train_ids).extend([*encoding.ids, eos_id])
    return TokenData(
        train=torch.tensor(train_ids, dtype=torch.int64),
        val=torch.tensor(val_ids, dtype=torch.int64),
        num_train_files=len(files) - num_val,
        num_val_files=num_val,
    )


def sample_batch(
    stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """``[batch_size, seq_len + 1]`` windows at seeded random offsets of ``stream``."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    return stream[(starts[:, None] + offsets[None, :]).to(stream.device)]


def val_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Back-to-back ``[n, seq_len + 1]`` windows from the start of the held-out stream."""
    n = min(max_windows, (stream.numel() - 1) // seq_len)
    if n < 1:
        raise ValueError(f"held-out stream of {stream.numel()} tokens is shorter than one window")
    starts = torch.arange(n) * seq_len
    return stream[starts[:, None] + torch.arange(seq_len + 1)[None, :]]


def make_optimizer(
    param_groups: list[tuple[list[torch.nn.Parameter], float]], weight_decay: float
) -> torch.optim.AdamW:
    """AdamW (fused on CUDA); matrices decay, vectors (norms) do not. Groups: (params, peak lr)."""
    groups: list[dict[str, object]] = []
    for params, lr in param_groups:
        matrices = [p for p in params if p.ndim >= 2]
        vectors = [p for p in params if p.ndim < 2]
        groups.append({"params": matrices, "lr": lr, "peak_lr": lr, "weight_decay": weight_decay})
        groups.append({"params": vectors, "lr": lr, "peak_lr": lr, "weight_decay": 0.0})
    fused = all(p.is_cuda for params, _ in param_groups for p in params)
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, fused=fused)  # type: ignore[arg-type]


def cosine_lr(step: int, total_steps: int, warmup_steps: int, min_ratio: float = 0.1) -> float:
    """Multiplier of the peak lr: linear warm-up, then cosine decay to ``min_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class StepBudget:
    """Fixes the number of steps from a time budget after a short timed probe.

    The first ``probe_steps`` steps run inside the warm-up (their lr does not depend on the
    total); their median duration (after ``skip`` warm-up steps) sets
    ``total = min(max_steps, budget_s / step_s)``. With ``budget_s=None`` the total is
    ``max_steps`` from the start, so a run can be repeated step for step.
    """

    def __init__(self, max_steps: int, budget_s: float | None, probe_steps: int = 12) -> None:
        self.total_steps: int | None = max_steps if budget_s is None else None
        self._max_steps, self._budget_s, self._probe_steps = max_steps, budget_s, probe_steps
        self._durations: list[float] = []
        self._last = time.perf_counter()

    def tick(self, step: int, device: torch.device) -> None:
        """Call after each step; ends the probe once enough steps were timed."""
        if self.total_steps is not None:
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        self._durations.append(now - self._last)
        self._last = now
        if len(self._durations) >= self._probe_steps:
            timed = sorted(self._durations[3:])
            step_s = timed[len(timed) // 2]
            assert self._budget_s is not None
            self.total_steps = max(step + 2, min(self._max_steps, int(self._budget_s / step_s)))
            print(f"  probe: {step_s * 1e3:.1f} ms/step -> {self.total_steps} steps", flush=True)

    def horizon(self) -> int:
        """The total used by the lr schedule (max_steps until the probe has decided)."""
        return self.total_steps if self.total_steps is not None else self._max_steps
