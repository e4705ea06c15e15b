"""Frozen configuration of the CPU scheduler."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SchedulerConfig"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and features of one ``Scheduler``.

    ``long_prefill_token_threshold = 0`` turns the per-request prefill cap off. ``debug`` checks
    the scheduler invariants after every ``schedule`` / ``update_from_output`` (slow; tests).
    """

    max_model_len: int
    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    num_spec_tokens: int = 0
    debug: bool = False

    def __post_init__(self) -> None:
        for name in ("max_model_len", "num_gpu_blocks", "block_size", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (a prompt token and an output), got {self.max_model_len}"
            )
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0 = off), got {self.long_prefill_token_threshold}"
            )
        if self.long_prefill_token_threshold > 0 and not self.enable_chunked_prefill:
            raise ValueError(
                "long_prefill_token_threshold chunks prompts: it needs chunked prefill"
            )
        if self.max_num_batched_tokens < 1 + self.num_spec_tokens:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold one decode step"
                f" with {self.num_spec_tokens} spec tokens"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be >= max_model_len ({self.max_model_len}) so every prompt fits one step"
            )
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"{self.num_gpu_blocks} blocks of {self.block_size} slots cannot hold one request"
                f" of max_model_len={self.max_model_len}"
            )

    @property
    def max_num_blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)
