"""The device sampler: penalties -> temperature -> top-k / top-p / min-p -> Gumbel-max.

Everything stays on the device and nothing reads device values on the host; the only host
inputs are SamplingMetadata's flags. Randomness is the counter-based noise of
:mod:`engine.kernels.noise`, keyed by (request seed, position), so a seeded request samples the
same tokens in any batch.

Filtering is expressed as one threshold per row in scaled-logit units: a token is kept iff
``l_v / T >= threshold``. This keeps ties at the boundary together (no dependence on sort
stability) and lets the sampling kernel apply all three filters with one compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.kernels.backend import KernelBackend, TorchKernels
from engine.kernels.noise import NoiseStream
from engine.sample.logprobs import compute_topk_logprobs
from engine.sample.metadata import SamplingMetadata
from engine.sample.penalties import apply_penalties
from engine.sample.sampling_inputs import SamplingRows

__all__ = [
    "Sampler",
    "SamplerOutput",
    "apply_sampling_penalties",
    "keep_thresholds",
    "process_logits",
    "compute_probs",
    "filter_thresholds",
]


@dataclass(frozen=True)
class SamplerOutput:
    """Device tensors of one sampling step.

    sampled_token_ids: [N] int64. When logprobs were requested (k = max_num_logprobs):
    logprob_token_ids [N, k+1] int64 and logprobs [N, k+1] f32 (column 0 = the sampled token,
    then the top-k of the raw distribution), sampled_token_ranks [N] int64; else all None.
    """

    sampled_token_ids: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_token_ranks: torch.Tensor | None = None


# stepscope: hot
def apply_sampling_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Penalised logits (out of place), or ``logits`` itself when no row penalises. [N, V]."""
    if meta.no_penalties:
        return logits
    assert meta.output_bin_counts is not None and meta.prompt_bin_mask is not None
    return apply_penalties(
        logits,
        meta.output_bin_counts,
        meta.prompt_bin_mask,
        meta.repetition_penalties,
        meta.presence_penalties,
        meta.frequency_penalties,
    )


# stepscope: hot
def keep_thresholds(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Per-row threshold t such that top-k, min-p then top-p keep exactly {v : s_v >= t}.

    scaled: [N, V] f32 temperature-scaled logits s; top_k [N] int32 (0 = off); top_p, min_p [N].

    * top-k: t_k = the k-th largest s (ties at t_k are all kept);
    * min-p: p_v >= min_p * p_max  <=>  s_v >= s_max + log(min_p);
    * top-p on the distribution renormalised over what top-k and min-p kept: walking tokens in
      descending order, keep v while the mass strictly before it is < top_p (so the token that
      crosses top_p is kept); t_p = the smallest kept value.

    Cost: one descending sort per row, O(V log V); on a GPU torch's segmented radix sort of
    [256, 152k] f32 takes a few hundred microseconds. Called only when some row filters.
    """
    vocab_size = scaled.shape[1]
    # sorted_vals: [N, V], descending
    sorted_vals = torch.sort(scaled, dim=-1, descending=True).values
    k = top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k > vocab_size), torch.full_like(k, vocab_size), k)
    threshold = sorted_vals.gather(1, (k - 1)[:, None]).squeeze(1)
    log_min_p = torch.log(min_p)  # log(0) = -inf: min-p off
    threshold = torch.maximum(threshold, sorted_vals[:, 0] + log_min_p)
    kept = sorted_vals >= threshold[:, None]
    probs = torch.softmax(sorted_vals.masked_fill(~kept, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    num_kept = ((mass_before < top_p[:, None]) & kept).sum(dim=-1).clamp(min=1)
    top_p_threshold = sorted_vals.gather(1, (num_kept - 1)[:, None]).squeeze(1)
    # top_p == 1 keeps everything, even where fp32 rounding pushes the running mass past 1.
    top_p_threshold = torch.where(
        top_p >= 1.0, torch.full_like(top_p_threshold, float("-inf")), top_p_threshold
    )
    return torch.maximum(threshold, top_p_threshold)


def _safe_temperature(temperature: torch.Tensor) -> torch.Tensor:
    return torch.where(temperature == 0, torch.ones_like(temperature), temperature)


# stepscope: hot
def _thresholds(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.no_top_k_top_p_min_p:
        return torch.full_like(meta.temperature, -math.inf)
    scaled = logits / _safe_temperature(meta.temperature)[:, None]
    return keep_thresholds(scaled, meta.top_k, meta.top_p, meta.min_p)


# stepscope: hot
def filter_thresholds(
    logits: torch.Tensor, states: SamplingRows, rows: torch.Tensor
) -> torch.Tensor:
    """:func:`keep_thresholds` of unpenalised ``logits: [N, V]`` with the top-k / top-p / min-p
    and temperature of state ``rows: [N]`` int64, gathered from the table. [N] f32."""
    cols = states.sampling_columns(rows)  # name -> [N] f32
    scaled = logits / _safe_temperature(cols["temperature"])[:, None]
    return keep_thresholds(scaled, states.top_k_of(rows), cols["top_p"], cols["min_p"])


# stepscope: hot
def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The processed logits s_v = l'_v / T, -inf outside the kept set. [N, V] f32.

    l' are the penalised logits. Greedy rows (T = 0) are scaled by 1; filtering never removes
    their argmax.
    """
    logits = apply_sampling_penalties(logits, meta)
    scaled = logits / _safe_temperature(meta.temperature)[:, None]
    if meta.no_top_k_top_p_min_p:
        return scaled
    threshold = keep_thresholds(scaled, meta.top_k, meta.top_p, meta.min_p)
    return scaled.masked_fill(scaled < threshold[:, None], float("-inf"))


# stepscope: hot
def compute_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution the sampler draws from: softmax(process_logits). [N, V] f32.

    Greedy rows get a one-hot at argmax of the penalised logits, the token they would sample,
    which is what the rejection sampler needs for them.
    """
    processed = process_logits(logits, meta)
    # one_hot: [N, V]
    one_hot = torch.nn.functional.one_hot(processed.argmax(-1), logits.shape[1]).to(logits.dtype)
    if meta.all_greedy:
        return one_hot
    probs = torch.softmax(processed, dim=-1)
    return torch.where((meta.temperature == 0)[:, None], one_hot, probs)


class Sampler:
    """Samples one token per row on the device. Stateless; all per-request state is in meta."""

    def __init__(self, kernels: KernelBackend | None = None) -> None:
        self.kernels = kernels or TorchKernels()  # default: the torch references

    # stepscope: hot
    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [N, V] f32 -> SamplerOutput; no host synchronisation.

        Sampling rule per row with T > 0 (Gumbel-max trick):
            token = argmax_v (l'_v / T + g_v)  over kept v,  g_v = -log(-log u_v),
            u_v = u(seed, position, v);  P(token = v) = softmax(l' / T) over the kept set.
        With T = 0: token = argmax_v l'_v.
        """
        # logits: [N, V] raw; penalised: [N, V]
        penalised = apply_sampling_penalties(logits, meta)
        if meta.all_greedy:
            sampled = penalised.argmax(dim=-1)
        else:
            threshold = _thresholds(penalised, meta)
            sampled = self.kernels.gumbel_sample(
                penalised,
                meta.temperature,
                threshold,
                meta.seeds,
                meta.positions,
                NoiseStream.SAMPLE,
            )
        return self.output(logits, sampled, meta.max_num_logprobs)

    # stepscope: hot
    def output(
        self, logits: torch.Tensor, sampled: torch.Tensor, max_num_logprobs: int | None
    ) -> SamplerOutput:
        """``sampled: [N]`` with, when asked, the top-``max_num_logprobs`` logprobs of the raw
        ``logits: [N, V]`` (and the sampled token's)."""
        if max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        logprobs = compute_topk_logprobs(logits, max_num_logprobs, sampled, self.kernels)
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprob_token_ids=logprobs.token_ids,
            logprobs=logprobs.logprobs,
            sampled_token_ranks=logprobs.ranks,
        )
