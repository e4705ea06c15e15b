"""The rejection-scan Triton kernel under TRITON_INTERPRET=1 against its torch reference, and a
whole probabilistic verify with Triton kernels against the torch path."""

from __future__ import annotations

import os

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from engine.kernels.backend import create_kernel_backend  # noqa: E402
from engine.kernels.rejection import rejection_scan_torch, rejection_scan_triton  # noqa: E402
from engine.sample.metadata import build_sampling_metadata  # noqa: E402
from engine.sample.sampler import Sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.spec.rejection import RejectionSampler  # noqa: E402

# tests/conftest.py sets TRITON_INTERPRET=1 (before any import) when there is no CUDA device;
# on a CUDA machine these interpreter tests are skipped (the GPU tests run the compiled kernels).
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter tests run without CUDA"
)


def _case(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    rows_per_req = torch.tensor([1, 4, 2, 5, 3, 1, 4])
    n = int(rows_per_req.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), rows_per_req.cumsum(0)]).to(torch.int32)
    draft = torch.randint(0, 50, (n,), generator=g)
    accepted = torch.rand(n, generator=g) < 0.7
    fallback = torch.randint(50, 100, (n,), generator=g)
    return cu, draft, accepted, fallback


@interpreted
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_scan_triton_matches_torch(seed: int) -> None:
    cu, draft, accepted, fallback = _case(seed)
    ref_out, ref_acc = rejection_scan_torch(cu, draft, accepted, fallback)
    out, acc = rejection_scan_triton(cu, draft, accepted, fallback, max_rows_per_req=5)
    assert torch.equal(out, ref_out)
    assert torch.equal(acc, ref_acc)
    assert (ref_acc >= 0).all() and (ref_acc <= (cu[1:] - cu[:-1] - 1)).all()


@interpreted
def test_probabilistic_verify_triton_matches_torch() -> None:
    g = torch.Generator().manual_seed(5)
    num_reqs, k, vocab = 4, 3, 29
    n = num_reqs * (k + 1)
    logits = torch.randn(n, vocab, generator=g) * 2
    draft_probs = torch.softmax(torch.randn(n, vocab, generator=g), -1)
    draft_ids = torch.multinomial(draft_probs, 1, generator=g)[:, 0]
    params = [SamplingParams(temperature=t, seed=7 + i) for i, t in enumerate([1.0, 0.0, 0.8, 1.3])]
    meta = build_sampling_metadata(
        [p for p in params for _ in range(k + 1)], list(range(100, 100 + n)), vocab_size=vocab
    )
    cu = torch.arange(0, n + 1, k + 1, dtype=torch.int32)
    outs = [
        RejectionSampler(Sampler(create_kernel_backend(name))).verify(
            logits, meta, draft_ids, draft_probs, cu, k + 1
        )
        for name in ("torch", "triton")
    ]
    assert torch.equal(outs[0].token_ids, outs[1].token_ids)
    assert torch.equal(outs[0].num_accepted, outs[1].num_accepted)
