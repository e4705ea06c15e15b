"""CUDA-only: Triton attention / KV write vs torch at real shapes, CUDA-graph replay, Qwen3 shape."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels.attention import paged_attention_torch, paged_attention_triton
from engine.kernels.attention_metadata import AttentionMetadata
from engine.kernels.backend import create_kernel_backend
from engine.kernels.kv_write import write_kv_torch, write_kv_triton
from engine.model.loader import build_random_model, qwen3_0_6b_config
from engine.model.paged_batch import build_attention_metadata

pytestmark = pytest.mark.gpu
BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 16, 8, 128


def _random_batch(
    q_lens: list[int], seq_lens: list[int], dtype: torch.dtype, seed: int, **padding: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-s // BLOCK_SIZE) for s in seq_lens]
    pool = list(range(sum(need) + 8))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in need]
    shape = (2, len(pool) + sum(need), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    computed = [s - q for s, q in zip(seq_lens, q_lens, strict=True)]
    md, _ = build_attention_metadata(computed, q_lens, tables, BLOCK_SIZE, "cuda", **padding)
    q = torch.randn(md.num_tokens, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    return q, kv_cache, md


BATCHES = {
    "decode_64": ([1] * 64, [random.Random(i).randint(1, 2000) for i in range(64)]),
    "prefill_chunked": ([512, 300, 7], [512, 1100, 7]),
    "verify_4": ([4] * 16, [random.Random(i).randint(4, 900) for i in range(16)]),
    "mixed": ([1] * 30 + [200], [random.Random(i).randint(1, 700) for i in range(30)] + [333]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_triton_attention_matches_torch_on_cuda(name: str, dtype: torch.dtype) -> None:
    q_lens, seq_lens = BATCHES[name]
    q, kv_cache, md = _random_batch(
        q_lens, seq_lens, dtype, seed=1, num_padded_tokens=len(q_lens) + sum(q_lens)
    )
    expected = paged_attention_torch(q, kv_cache, md, HEAD_DIM**-0.5).float()
    got = paged_attention_triton(q, kv_cache, md, HEAD_DIM**-0.5).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("head_major", [False, True])
def test_varlen_split_decodes_on_cuda(head_major: bool) -> None:
    """``split_decodes`` at the mixed step's real shape (bf16, the tuned tiles): 64 decodes and 16
    prompts of 128, padded tokens and requests, equal to the torch reference; padding rows 0."""
    from engine.kernels.attention import VARLEN_LAUNCH, paged_varlen_attention_triton

    rng = random.Random(5)
    q_lens = [1] * 64 + [128] * 16
    seq_lens = [rng.randint(200, 300) for _ in range(64)] + [128] * 16
    q, kv_cache, md = _random_batch(q_lens, seq_lens, torch.bfloat16, seed=5,
                                    num_padded_tokens=sum(q_lens) + 40, num_padded_reqs=90)  # fmt: skip
    launch = dict(VARLEN_LAUNCH[2], split_decodes=True, head_major=head_major)
    expected = paged_attention_torch(q, kv_cache, md, HEAD_DIM**-0.5).float()
    got = paged_varlen_attention_triton(q, kv_cache, md, HEAD_DIM**-0.5, launch).float()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    assert torch.all(got[sum(q_lens) :] == 0)


def test_write_kv_triton_matches_torch_on_cuda() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(2, 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", generator=gen)
    slots = torch.randperm(64 * BLOCK_SIZE, device="cuda", generator=gen)[:300]
    slots[::7] = -1
    k = torch.randn(300, NUM_KV_HEADS, HEAD_DIM, device="cuda", generator=gen)
    v = torch.randn(300, NUM_KV_HEADS, HEAD_DIM, device="cuda", generator=gen)
    expected = cache.clone()
    write_kv_torch(k, v, expected, slots)
    write_kv_triton(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_attention_cuda_graph_replay_with_new_lengths() -> None:
    """Captured once at a padded shape; replays follow new seq_lens read on the device."""
    q, kv_cache, md = _random_batch([1] * 6, [5, 40, 90, 17, 3, 64], torch.bfloat16, seed=2,
                                    num_padded_tokens=8, num_padded_reqs=8)  # fmt: skip
    scale = HEAD_DIM**-0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention_triton(q, kv_cache, md, scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(q, kv_cache, md, scale)
    for seed, new_lens in ((3, [70, 2, 33, 90, 1, 16]), (4, [1, 1, 96, 50, 8, 9])):
        md.seq_lens[:6].copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(
            torch.randn(q.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        )
        graph.replay()
        new_md = AttentionMetadata(md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping,
                                   md.num_reqs, md.num_tokens, 1, max(new_lens))  # fmt: skip
        expected = paged_attention_torch(q, kv_cache, new_md, scale)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
        assert torch.all(out[6:] == 0)


def test_qwen3_shape_triton_vs_torch_logits() -> None:
    config = qwen3_0_6b_config()
    models = {
        t: build_random_model(
            config,
            torch.bfloat16,
            "cuda",
            seed=0,
            kernels=create_kernel_backend("triton" if t else "torch"),
        )
        for t in (False, True)
    }
    q_lens, computed = [40, 1, 1, 3], [0, 100, 7, 20]
    tables = [[i * 16 + j for j in range(10)] for i in range(4)]
    logits = {}
    for use_triton, model in models.items():
        kv_caches = model.allocate_kv_caches(64, BLOCK_SIZE)
        # fill the context first with one prefill per request, then run the mixed step
        md0, pos0 = build_attention_metadata([0] * 4, computed, tables, BLOCK_SIZE, "cuda")
        ids0 = torch.randint(0, config.vocab_size, (md0.num_tokens,), device="cuda",
                             generator=torch.Generator("cuda").manual_seed(1))  # fmt: skip
        md, pos = build_attention_metadata(computed, q_lens, tables, BLOCK_SIZE, "cuda")
        ids = torch.randint(0, config.vocab_size, (md.num_tokens,), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(2))  # fmt: skip
        with torch.no_grad():
            model(ids0, pos0, md0, kv_caches)
            logits[use_triton] = model.compute_logits(model(ids, pos, md, kv_caches))
    diff = (logits[True] - logits[False]).abs().max() / logits[False].abs().max()
    print(f"qwen3-0.6b shape, bf16: triton vs torch max relative logit diff {diff:.3e}")
    assert diff < 3e-2, f"relative diff {diff:.3e}"
