"""Stateless counter-based noise for sampling.

Every random number the sampler uses is a pure function of
``(request seed, position, vocab index, stream)``: no generator state, no dependence on the batch
size, the row order or the other requests in the batch. A seeded request therefore yields the
same tokens in any batch, with async scheduling on or off, and a step can be replayed exactly.

The hash works on 32-bit words held in int64 tensors (torch has no wrapping uint32 arithmetic on
every backend), so every intermediate stays in ``[0, 2**49)`` and never overflows:

* per row, two independent 32-bit keys are chained from the stream id, the two halves of the
  seed and the two halves of the position (:func:`noise_row_keys`);
* per element, ``h(v) = mix32(mix32(v ^ key1) ^ key2)`` with ``mix32`` the "lowbias32" integer
  finaliser (two multiply-xorshift rounds, full avalanche);
* ``u = (h >> 9 + 0.5) / 2**23`` is uniform on a 2**23-point grid strictly inside (0, 1) and exact
  in fp32 (the largest value, 1 - 2**-24, is representable, so ``log u < 0`` always);
* ``g = -log(-log u)`` is a standard Gumbel variate.

The Triton kernels in :mod:`engine.kernels.sampling` compute the per-element part with the same
integer operations, so torch and Triton agree bit for bit on ``h`` and ``u``.
"""

from __future__ import annotations

from enum import IntEnum

import torch

__all__ = [
    "NoiseStream",
    "mix32",
    "noise_row_keys",
    "hash_from_row_keys",
    "uniform_from_row_keys",
    "uniform_noise",
    "gumbel_noise",
]

MASK32 = 0xFFFFFFFF
MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B
# Distinct odd starting constants for the two key chains, so the keys are independent words.
KEY1_INIT = 0x9E3779B9
KEY2_INIT = 0x85EBCA77
UNIFORM_BITS = 23


class NoiseStream(IntEnum):
    """Independent noise streams drawn for the same (seed, position)."""

    SAMPLE = 0  # Gumbel noise of ordinary sampling (and of draft tokens)
    ACCEPT = 1  # speculative decoding: the acceptance test u < p/q
    RECOVER = 2  # speculative decoding: sampling the recovered token from max(p - q, 0)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for x in [0, 2**32), without int64 overflow.

    constant = hi * 2**16 + lo, so x * constant = x * lo + (x * hi mod 2**16) * 2**16 (mod 2**32);
    both products are below 2**48.
    """
    lo = constant & 0xFFFF
    hi = constant >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finaliser: a bijection of [0, 2**32) with near-ideal avalanche. x: int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MUL2)
    return x ^ (x >> 16)


def _chain(init: int, words: list[torch.Tensor], stream: int) -> torch.Tensor:
    h = mix32(torch.full_like(words[0], (init + stream) & MASK32))
    for word in words:
        h = mix32(h ^ word)
    return h


def noise_row_keys(
    seeds: torch.Tensor, positions: torch.Tensor, stream: int = NoiseStream.SAMPLE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 32-bit keys per row, from (seed, position, stream).

    seeds: [N] int64 in [0, 2**63); positions: [N] int64 >= 0. Returns (key1, key2): [N] int64
    each, values in [0, 2**32).
    """
    seeds = seeds.to(torch.int64)
    positions = positions.to(torch.int64)
    words = [
        seeds & MASK32,
        (seeds >> 32) & MASK32,
        positions & MASK32,
        (positions >> 32) & MASK32,
    ]
    return _chain(KEY1_INIT, words, int(stream)), _chain(KEY2_INIT, words, int(stream))


def hash_from_row_keys(key1: torch.Tensor, key2: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The 32-bit hash of every (row, vocab index). key1, key2: [N] int64 -> [N, vocab] int64."""
    vocab_ids = torch.arange(vocab_size, dtype=torch.int64, device=key1.device)
    inner = mix32(vocab_ids[None, :] ^ key1[:, None])
    return mix32(inner ^ key2[:, None])


def uniform_from_row_keys(key1: torch.Tensor, key2: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform u in (0, 1), fp32, [N, vocab]: u = (h >> 9 + 1/2) * 2**-23."""
    bits = hash_from_row_keys(key1, key2, vocab_size) >> (32 - UNIFORM_BITS)
    return (bits.to(torch.float32) + 0.5) * (2.0**-UNIFORM_BITS)


def uniform_noise(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    vocab_size: int,
    stream: int = NoiseStream.SAMPLE,
) -> torch.Tensor:
    """u(seed, position, v, stream) in (0, 1) for every row and vocab index: [N, vocab] fp32.

    seeds, positions: [N] int64. For a single uniform per row (the acceptance test), use
    ``vocab_size=1``: column 0 is that row's draw.
    """
    key1, key2 = noise_row_keys(seeds, positions, stream)
    return uniform_from_row_keys(key1, key2, vocab_size)


def gumbel_noise(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    vocab_size: int,
    stream: int = NoiseStream.SAMPLE,
) -> torch.Tensor:
    """Standard Gumbel noise g = -log(-log u), [N, vocab] fp32, keyed like :func:`uniform_noise`."""
    u = uniform_noise(seeds, positions, vocab_size, stream)
    return -torch.log(-torch.log(u))
