"""Batch-invariant mode on CUDA (docs/design.md §2.16): the bit-exact claims the CPU tests can
only check under the interpreter. A GEMM row and an attention row come out the same whatever
batch they run in, and greedy speculative decoding then emits exactly the tokens of plain
decoding in float32."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels.backend import TritonKernels
from engine.kernels.batch_invariant import linear
from engine.model.paged_batch import build_attention_metadata
from tests.engine.test_batch_invariant import MODELS, _paged_kv, plain_and_spec_tokens

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_rows_do_not_depend_on_the_batch_on_cuda(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(4096, 1024, generator=gen, device="cuda").to(dtype)
    x = torch.randn(300, 1024, generator=gen, device="cuda").to(dtype)
    full = linear(x, weight)
    for rows in (list(range(64)), [299, 3, 150], list(range(0, 300, 7))):
        assert torch.equal(linear(x[rows], weight), full[rows]), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_rows_equal_verify_rows_on_cuda(dtype: torch.dtype) -> None:
    """64 requests verify 4 tokens; the same requests decoding one of those tokens (same KV,
    same query) get the verify's row to the bit."""
    block, hq, hkv, d, k, n = 16, 16, 8, 128, 4, 64
    rng = random.Random(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    seq_lens = [rng.randint(k, 900) for _ in range(n)]
    tables, kv_cache = _paged_kv(seq_lens, block, hkv, d, rng, gen)
    kv_cache = kv_cache.to(dtype)
    verify_md, _ = build_attention_metadata(
        [s - k for s in seq_lens], [k] * n, tables, block, "cuda", num_padded_tokens=n * k + 8
    )
    q = torch.randn(verify_md.num_tokens, hq, d, generator=gen, device="cuda").to(dtype)
    picks = [rng.randrange(k) for _ in seq_lens]
    decode_md, _ = build_attention_metadata(
        [s - k + j for s, j in zip(seq_lens, picks, strict=True)], [1] * n, tables, block, "cuda"
    )
    rows = [k * r + j for r, j in enumerate(picks)]
    inv = TritonKernels(invariant=True)
    verify = inv.paged_attention(q, kv_cache, verify_md, d**-0.5)
    decode = inv.paged_attention(q[rows].contiguous(), kv_cache, decode_md, d**-0.5)
    assert torch.equal(decode, verify[rows])
    assert not verify[n * k :].any()  # padding tokens: zeros


def test_speculative_greedy_tokens_equal_plain_decoding_on_cuda() -> None:
    """Sample models, float32, greedy, batch-invariant: EAGLE k=3 emits none's tokens for every
    request (CUDA graphs and Triton on, as by default)."""
    from engine.workload import load_workload

    workload = load_workload(str(MODELS.parent / "workloads" / "pycode_prompts.jsonl"))[:24]
    plain, eagle = plain_and_spec_tokens("cuda", [w.prompt for w in workload], 64)
    assert all(plain) and plain == eagle
