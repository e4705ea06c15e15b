"""Device sampler: counter-based noise, penalties, filtering, Gumbel-max sampling, logprobs."""

from engine.kernels.noise import NoiseStream, gumbel_noise, noise_row_keys, uniform_noise
from engine.sample.logprobs import LogprobsTensors, compute_topk_logprobs, prompt_logprobs_chunked
from engine.sample.metadata import SamplingMetadata, build_sampling_metadata
from engine.sample.penalties import (
    apply_penalties,
    reset_penalty_rows,
    set_prompt_bin_mask,
    update_output_bin_counts,
)
from engine.sample.sampler import Sampler, SamplerOutput, compute_probs, process_logits

__all__ = [
    "LogprobsTensors",
    "NoiseStream",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_penalties",
    "build_sampling_metadata",
    "compute_probs",
    "compute_topk_logprobs",
    "gumbel_noise",
    "noise_row_keys",
    "process_logits",
    "prompt_logprobs_chunked",
    "reset_penalty_rows",
    "set_prompt_bin_mask",
    "uniform_noise",
    "update_output_bin_counts",
]
