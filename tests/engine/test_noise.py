"""Counter-based noise: the hash against a pure-Python uint32 reference, key independence from
the batch, range and uniformity of u."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kernels.noise import (
    NoiseStream,
    gumbel_noise,
    hash_from_row_keys,
    mix32,
    noise_row_keys,
    uniform_noise,
)

M32 = 0xFFFFFFFF


def mix32_py(x: int) -> int:
    """lowbias32 in plain Python ints (Chris Wellons' published constants)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def row_keys_py(seed: int, position: int, stream: int) -> tuple[int, int]:
    words = [seed & M32, seed >> 32, position & M32, position >> 32]
    keys = []
    for init in (0x9E3779B9, 0x85EBCA77):
        h = mix32_py((init + stream) & M32)
        for w in words:
            h = mix32_py(h ^ w)
        keys.append(h)
    return keys[0], keys[1]


def test_mix32_matches_python_uint32_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    xs = torch.randint(0, 2**32, (2000,), generator=gen, dtype=torch.int64)
    xs = torch.cat([xs, torch.tensor([0, 1, M32, 2**31, 2**31 - 1])])
    assert mix32(xs).tolist() == [mix32_py(x) for x in xs.tolist()]


@pytest.mark.parametrize(
    ("seed", "position", "stream"),
    [(0, 0, 0), (12345, 7, 1), (2**63 - 1, 2**40 + 3, 2), (2**32, 2**32 - 1, 0)],
)
def test_full_hash_matches_python_reference(seed: int, position: int, stream: int) -> None:
    key1, key2 = noise_row_keys(torch.tensor([seed]), torch.tensor([position]), stream)
    assert (key1.item(), key2.item()) == row_keys_py(seed, position, stream)
    k1, k2 = row_keys_py(seed, position, stream)
    expected = [mix32_py(mix32_py(v ^ k1) ^ k2) for v in range(50)]
    assert hash_from_row_keys(key1, key2, 50)[0].tolist() == expected


def test_noise_depends_only_on_its_own_key() -> None:
    seeds = torch.tensor([5, 9, 5, 2**62, 77], dtype=torch.int64)
    positions = torch.tensor([3, 3, 4, 10, 0], dtype=torch.int64)
    batch = gumbel_noise(seeds, positions, 40)
    for i in range(5):
        alone = gumbel_noise(seeds[i : i + 1], positions[i : i + 1], 40)
        assert torch.equal(alone[0], batch[i])
    perm = torch.tensor([4, 2, 0, 3, 1])
    assert torch.equal(gumbel_noise(seeds[perm], positions[perm], 40), batch[perm])
    # Different position, seed or stream: different noise.
    assert not torch.equal(batch[0], batch[2])
    assert not torch.equal(batch[0], batch[1])
    other_stream = gumbel_noise(seeds, positions, 40, NoiseStream.ACCEPT)
    assert not torch.equal(other_stream[0], batch[0])


def test_uniform_range_and_uniformity() -> None:
    seeds = torch.arange(256, dtype=torch.int64) * 7919
    positions = torch.arange(256, dtype=torch.int64) % 17
    u32 = uniform_noise(seeds, positions, 512).flatten()
    assert u32.dtype == torch.float32 and u32.min() > 0 and u32.max() < 1
    u = u32.double()
    # Chi-square of 64 equal bins over 131072 draws.
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    expected = u.numel() / 64
    stat = ((counts - expected) ** 2 / expected).sum()
    p_value = torch.special.gammaincc(torch.tensor(63 / 2, dtype=torch.float64), stat / 2)
    assert p_value > 1e-3, f"uniformity rejected: chi2={stat:.1f}, p={p_value:.2e}"
    # Neighbouring vocab columns and neighbouring positions are uncorrelated.
    grid = uniform_noise(torch.zeros(2048, dtype=torch.int64), torch.arange(2048), 2).double()
    for a, b in ((grid[:, 0], grid[:, 1]), (grid[:-1, 0], grid[1:, 0])):
        corr = torch.corrcoef(torch.stack([a, b]))[0, 1]
        assert abs(corr) < 4 / math.sqrt(2048)


def test_extreme_uniforms_give_finite_gumbel() -> None:
    # The grid's ends, u = 2**-24 and 1 - 2**-24, are exact in fp32 and give finite noise.
    ends = torch.tensor([0.5 * 2**-23, 1 - 0.5 * 2**-23], dtype=torch.float32)
    assert ends[1] < 1.0
    g = -torch.log(-torch.log(ends))
    assert torch.isfinite(g).all()
    noise = gumbel_noise(torch.arange(64), torch.arange(64), 1024)
    assert torch.isfinite(noise).all()
    # Mean of a standard Gumbel is the Euler-Mascheroni constant.
    assert abs(noise.double().mean().item() - 0.5772) < 0.02
