"""Batch-invariant mode (``--batch-invariant``, docs/design.md §2.16): a row's GEMM result and a
decode row's attention do not depend on the batch they run in, so a speculative verify computes
the logits a plain decode step computes, to the bit. CPU here (Triton under the interpreter);
the CUDA proof is ``test_batch_invariant_gpu.py``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import ConfigError, EngineConfig
from engine.kernels.backend import TorchKernels, TritonKernels, create_kernel_backend
from engine.kernels.batch_invariant import INVARIANT_ROWS, linear
from engine.model.paged_batch import build_attention_metadata

MODELS = Path(__file__).resolve().parents[2] / "samples" / "models"


def _paged_kv(
    seq_lens: list[int], block: int, hkv: int, d: int, rng: random.Random, gen: torch.Generator
) -> tuple[list[list[int]], torch.Tensor]:
    """Block tables (shuffled, non-contiguous blocks, a few spare) and a random KV cache
    ``[2, blocks, block, hkv, d]`` on ``gen``'s device for requests of ``seq_lens`` tokens."""
    need = [-(-s // block) for s in seq_lens]
    pool = list(range(sum(need) + 4))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in need]
    kv = torch.randn(2, sum(need) + 4, block, hkv, d, generator=gen, device=gen.device)
    return tables, kv


def plain_and_spec_tokens(device: str, prompts: list, max_tokens: int) -> list[list[list[int]]]:
    """Greedy outputs of the sample model under --batch-invariant in float32, without
    speculation and with EAGLE k=3: ``[plain, eagle]``, token ids per prompt."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = []
    for spec in ({}, {"spec_method": "eagle", "spec_model": str(MODELS / "pycoder-14m-eagle"),
                      "num_spec_tokens": 3}):  # fmt: skip
        llm = LLM(model=str(MODELS / "pycoder-14m"), device=device, dtype="float32",
                  batch_invariant=True, **spec)  # fmt: skip
        outputs.append([o.output_token_ids for o in llm.generate(prompts, params)])
        llm.close()
    return outputs


def test_linear_rows_do_not_depend_on_batch_or_position() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen)
    x = torch.randn(INVARIANT_ROWS + 40, 64, generator=gen)  # two chunks, the second padded
    full = linear(x, weight, bias)
    torch.testing.assert_close(full, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    for rows in ([3, 7], [290, 0, 5], list(range(INVARIANT_ROWS + 40))[::-37]):
        part = linear(x[rows], weight, bias)
        assert torch.equal(part, full[rows]), rows
    # Any leading shape: [..., K] -> [..., N]
    assert torch.equal(
        linear(x[:6].reshape(2, 3, 64), weight), linear(x[:6], weight).view(2, 3, 96)
    )


def test_backends_bind_their_linear() -> None:
    assert TorchKernels().linear is F.linear and not TorchKernels().batch_invariant
    inv = create_kernel_backend("torch", invariant=True)
    assert inv.batch_invariant and inv.linear is linear


def test_decode_rows_attend_as_the_rows_of_a_verify() -> None:
    """16 requests verify 4 tokens each; the same requests decoding the token at one of those 4
    positions (same KV cache, same query row) get the verify's output row exactly under the
    invariant backend (every token attended on its own, one fixed launch)."""
    block, hq, hkv, d, k = 16, 4, 2, 32, 4
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    seq_lens = [rng.randint(k, 90) for _ in range(16)]
    tables, kv_cache = _paged_kv(seq_lens, block, hkv, d, rng, gen)
    verify_md, _ = build_attention_metadata(
        [s - k for s in seq_lens], [k] * 16, tables, block, "cpu"
    )
    q = torch.randn(16 * k, hq, d, generator=gen)
    picks = [rng.randrange(k) for _ in seq_lens]
    decode_md, _ = build_attention_metadata(
        [s - k + j for s, j in zip(seq_lens, picks, strict=True)], [1] * 16, tables, block, "cpu"
    )
    rows = [k * r + j for r, j in enumerate(picks)]
    scale = d**-0.5
    inv = TritonKernels(invariant=True)
    verify = inv.paged_attention(q, kv_cache, verify_md, scale)
    decode = inv.paged_attention(q[rows].contiguous(), kv_cache, decode_md, scale)
    assert torch.equal(decode, verify[rows])
    # Both agree with the float reference, and the default backend's decode kernel too (close).
    plain = TritonKernels().paged_attention(q[rows].contiguous(), kv_cache, decode_md, scale)
    torch.testing.assert_close(plain, decode, rtol=1e-4, atol=1e-4)
    ref = TorchKernels().paged_attention(q, kv_cache, verify_md, scale)
    torch.testing.assert_close(verify, ref, rtol=1e-4, atol=1e-4)


def test_tensor_parallel_is_refused() -> None:
    with pytest.raises(ConfigError, match="batch_invariant needs tensor_parallel_size=1"):
        EngineConfig.from_flat(
            model_config="qwen3-0.6b", random_weights=True, batch_invariant=True,
            tensor_parallel_size=2,
        )  # fmt: skip


def test_per_token_attention_matches_the_reference_on_mixed_padded_batches() -> None:
    """Prefill chunks, verifies and decodes in one batch, with padding tokens and padded
    requests (a CUDA-graph shape): the per-token path gives the reference's rows, and zeros for
    the padding tokens."""
    block, hq, hkv, d = 16, 4, 2, 32
    q_lens, seq_lens = [1, 37, 4, 1, 20], [50, 37, 70, 9, 45]
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    tables, kv_cache = _paged_kv(seq_lens, block, hkv, d, rng, gen)
    md, _ = build_attention_metadata(
        [s - q for s, q in zip(seq_lens, q_lens, strict=True)], q_lens, tables, block, "cpu",
        num_padded_tokens=sum(q_lens) + 5, num_padded_reqs=len(q_lens) + 2,
    )  # fmt: skip
    q = torch.randn(md.num_tokens, hq, d, generator=gen)
    got = TritonKernels(invariant=True).paged_attention(q, kv_cache, md, d**-0.5)
    want = TorchKernels().paged_attention(q, kv_cache, md, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not got[sum(q_lens) :].any()


def test_speculative_greedy_tokens_equal_plain_decoding() -> None:
    """End to end on the CPU (sample models, fp32, greedy): EAGLE k=3 under --batch-invariant
    emits the tokens of the run without speculation, as the flag promises."""
    prompts = ["def add(a, b):", "import os\nfor name in", "class Stack:\n    def"]
    plain, eagle = plain_and_spec_tokens("cpu", prompts, 24)
    assert plain == eagle
