"""Per-step sampling inputs: device tensors per batch row plus host flags."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

__all__ = ["SamplingMetadata", "build_sampling_metadata"]


@dataclass(frozen=True)
class SamplingMetadata:
    """What the sampler needs for one step; one row per sampled token.

    Device tensors (all ``[num_rows]`` unless noted), gathered by the runner from its state table:

    * ``temperature`` f32, 0 = greedy; ``top_k`` int32, 0 = off; ``top_p`` f32, 1 = off;
      ``min_p`` f32, 0 = off;
    * ``seeds`` int64 and ``positions`` int64 (position of the token being sampled): the noise key;
    * ``repetition_penalties`` f32 (1 = off), ``presence_penalties`` and ``frequency_penalties``
      f32 (0 = off);
    * ``output_bin_counts`` ``[num_rows, vocab]`` int32 (how often each token was generated) and
      ``prompt_bin_mask`` ``[num_rows, vocab]`` bool (token occurs in the prompt); may be None
      when ``no_penalties``.

    Host flags come from the scheduler's records, never from reading the device:
    ``all_greedy`` (every row has temperature 0), ``no_top_k_top_p_min_p`` (no row filters),
    ``no_penalties`` (no row penalises), ``max_num_logprobs`` (None = no row wants logprobs).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    repetition_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    output_bin_counts: torch.Tensor | None
    prompt_bin_mask: torch.Tensor | None
    all_greedy: bool
    no_top_k_top_p_min_p: bool
    no_penalties: bool
    max_num_logprobs: int | None

    def __post_init__(self) -> None:
        # Shape and dtype checks only read host metadata: no device sync.
        expected = {
            "temperature": torch.float32,
            "top_k": torch.int32,
            "top_p": torch.float32,
            "min_p": torch.float32,
            "seeds": torch.int64,
            "positions": torch.int64,
            "repetition_penalties": torch.float32,
            "presence_penalties": torch.float32,
            "frequency_penalties": torch.float32,
        }
        num_rows = self.temperature.shape[0]
        for name, dtype in expected.items():
            tensor = getattr(self, name)
            if tensor.dtype != dtype or tuple(tensor.shape) != (num_rows,):
                raise ValueError(
                    f"{name} must be [{num_rows}] {dtype}, got {list(tensor.shape)} {tensor.dtype}"
                )
        for name, dtype in (("output_bin_counts", torch.int32), ("prompt_bin_mask", torch.bool)):
            tensor = getattr(self, name)
            if tensor is not None and (tensor.dtype != dtype or tensor.dim() != 2):
                raise ValueError(f"{name} must be [{num_rows}, vocab] {dtype}")
            if tensor is not None and tensor.shape[0] != num_rows:
                raise ValueError(f"{name} has {tensor.shape[0]} rows, expected {num_rows}")
        if not self.no_penalties and (
            self.output_bin_counts is None or self.prompt_bin_mask is None
        ):
            raise ValueError("penalties need output_bin_counts and prompt_bin_mask")
        if self.max_num_logprobs is not None and self.max_num_logprobs < 0:
            raise ValueError(f"max_num_logprobs must be >= 0, got {self.max_num_logprobs}")

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


def _bin_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.int32)
    for row, ids in enumerate(token_ids):
        if len(ids) > 0:
            ones = torch.ones(len(ids), dtype=torch.int32)
            counts[row].index_add_(0, torch.tensor(list(ids), dtype=torch.int64), ones)
    return counts.to(device)


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    *,
    vocab_size: int,
    default_seeds: Sequence[int] | None = None,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """Build metadata on the host from per-row SamplingParams (tests, offline tools).

    Rows with ``seed=None`` take ``default_seeds[row]`` (the runner assigns those). Penalty state
    is built from ``prompt_token_ids``/``output_token_ids`` when any row penalises.
    """
    num_rows = len(params)
    if len(positions) != num_rows:
        raise ValueError(f"{len(positions)} positions for {num_rows} rows")
    seeds = []
    for row, p in enumerate(params):
        if p.seed is not None:
            seeds.append(p.seed)
        elif default_seeds is not None:
            seeds.append(int(default_seeds[row]))
        else:
            raise ValueError(f"row {row} has no seed and no default_seeds were given")

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    top_k = [max(p.top_k, 0) for p in params]  # -1 and 0 both mean off
    no_penalties = not any(p.has_penalties for p in params)
    counts = mask = None
    if not no_penalties:
        empty: list[list[int]] = [[] for _ in range(num_rows)]
        counts = _bin_counts(output_token_ids or empty, vocab_size, device)
        mask = _bin_counts(prompt_token_ids or empty, vocab_size, device) > 0
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=f32([p.temperature for p in params]),
        top_k=torch.tensor(top_k, dtype=torch.int32, device=device),
        top_p=f32([p.top_p for p in params]),
        min_p=f32([p.min_p for p in params]),
        seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
        positions=torch.tensor(list(positions), dtype=torch.int64, device=device),
        repetition_penalties=f32([p.repetition_penalty for p in params]),
        presence_penalties=f32([p.presence_penalty for p in params]),
        frequency_penalties=f32([p.frequency_penalty for p in params]),
        output_bin_counts=counts,
        prompt_bin_mask=mask,
        all_greedy=all(p.is_greedy for p in params),
        no_top_k_top_p_min_p=all(
            k == 0 and p.top_p == 1.0 and p.min_p == 0.0 for k, p in zip(top_k, params, strict=True)
        ),
        no_penalties=no_penalties,
        max_num_logprobs=max(wanted) if wanted else None,
    )
