"""AsyncOutput reads a step's host buffers into a ModelRunnerOutput (docs/design.md §2.6, §5.5):
the wait for the output event (``wait``) apart from the read (``get``), accepted counts and
logprobs in the pooled step buffer, logprobs built only for the requests that asked. Checked
against a plain per-row Python reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.runner.async_output import AsyncOutput, HostOutputBuffers, SampledBufferPool
from engine.runner.input_batch import InputBatch


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _batch(per_req: list[int], returns: list[bool], num_logprobs: int | None) -> InputBatch:
    b, n = len(per_req), sum(per_req)
    return InputBatch(
        step=7,
        req_ids=[f"r{i}" for i in range(b)],
        rows=list(range(b)),
        query_lens=list(per_req),
        num_logits_per_req=list(per_req),
        returns_tokens=list(returns),
        num_reqs=b,
        num_tokens=n,
        num_logits=n,
        num_padded_reqs=b,
        num_padded_tokens=n,
        max_query_len=max(per_req),
        max_seq_len=64,
        is_uniform_decode=False,
        any_penalties=False,
        all_greedy=True,
        no_top_k_top_p_min_p=True,
        max_num_logprobs=num_logprobs,
        num_drafts=n - b,
        max_logits_per_req=max(per_req),
    )


def _reference(per_req, returns, accepted, sampled, ids, values, asked):
    """Row by row: request b owns rows cu[b] .. cu[b+1]; it emits accepted[b] + 1 of them."""
    tokens, counts, logprobs = [], [], []
    start = 0
    for b, n in enumerate(per_req):
        emit = accepted[b] + 1 if returns[b] else 0
        tokens.append([int(sampled[start + j]) for j in range(emit)])
        counts.append(accepted[b] if returns[b] else 0)
        lp = []
        if ids is not None and (asked is None or asked[b]):
            for j in range(emit):
                r = start + j
                lp.append([(int(i), float(v)) for i, v in zip(ids[r], values[r], strict=True)])
        logprobs.append(lp)
        start += n
    return tokens, counts, logprobs


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("with_logprobs", [False, True])
def test_spec_output_matches_the_row_by_row_reference(k: int, with_logprobs: bool) -> None:
    rng = np.random.default_rng(k)
    b = 24
    per_req = [1 + k if i % 5 else 1 for i in range(b)]  # some requests verify no drafts
    returns = [i % 7 != 3 for i in range(b)]  # some still prefilling
    accepted = [int(rng.integers(0, n)) for n in per_req]
    n = sum(per_req)
    pool = SampledBufferPool(_host_empty, n, b, logprob_cols=6)
    base = pool.take()
    host_sampled, host_counts = base[:n], pool.counts(base, b)
    host_sampled.copy_(torch.from_numpy(rng.integers(0, 5000, n)))
    host_counts.copy_(torch.tensor(accepted))
    ids = values = asked = None
    if with_logprobs:
        ids, values = pool.logprob_views(base, n, 6)
        ids.copy_(torch.from_numpy(rng.integers(0, 5000, (n, 6))))
        values.copy_(torch.from_numpy(rng.standard_normal((n, 6)).astype(np.float32)))
        asked = np.array([i % 3 == 0 for i in range(b)])
    host = HostOutputBuffers(
        sampled=host_sampled,
        num_accepted=host_counts,
        logprob_token_ids=ids,
        logprobs=values,
        sampled_base=base,
        logprobs_asked=asked,
    )
    # the reference reads copies: the pool may reuse the buffer once the output was read
    ref = _reference(
        per_req,
        returns,
        accepted,
        host_sampled.numpy().copy(),
        None if ids is None else ids.numpy().copy(),
        None if values is None else values.numpy().copy(),
        asked,
    )
    out = AsyncOutput(_batch(per_req, returns, 5 if with_logprobs else None), 7, host, None,
                      pool=pool).get()  # fmt: skip
    assert out.sampled_token_ids == ref[0]
    assert out.num_accepted == ref[1]
    if with_logprobs:
        assert out.logprobs == ref[2]
        assert all(type(t) is int and type(v) is float for r in out.logprobs for row in r
                   for t, v in row)  # fmt: skip
    else:
        assert out.logprobs is None
    assert pool.take() is base  # given back once read


def test_pool_views_are_disjoint_and_contiguous() -> None:
    """Tokens, counts, logprob ids and values of one pooled buffer never alias each other."""
    pool = SampledBufferPool(_host_empty, capacity=10, num_counts=4, logprob_cols=3)
    base = pool.take()
    tokens, counts = base[:10], pool.counts(base, 4)
    ids, values = pool.logprob_views(base, 10, 3)
    tokens.fill_(1)
    counts.fill_(2)
    ids.fill_(3)
    values.fill_(0.5)
    assert tokens.tolist() == [1] * 10 and counts.tolist() == [2] * 4
    assert ids.flatten().tolist() == [3] * 30 and values.flatten().tolist() == [0.5] * 30
    assert ids.is_contiguous() and values.is_contiguous() and values.dtype == torch.float32
    assert not pool.fits_logprobs(10, 4) and not pool.fits_logprobs(11, 3)
    with pytest.raises(ValueError, match="count slots"):
        pool.counts(base, 5)


class _Event:
    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1

    def query(self) -> bool:
        return True


def test_wait_is_the_event_only_and_get_reads_after_it() -> None:
    """``wait`` synchronises once and releases the event; ``get`` after it reads without waiting
    again; ``get`` alone waits first."""
    batch = _batch([1, 1], [True, True], None)

    def output(event: _Event, released: list) -> AsyncOutput:
        host = HostOutputBuffers(torch.tensor([5, 6]), None, None, None)
        return AsyncOutput(batch, 7, host, event, release=released.append)  # type: ignore[arg-type]

    event, released = _Event(), []
    out = output(event, released)
    out.wait()
    out.wait()
    assert event.waits == 1 and released == [event] and out.is_ready()
    assert out.get().sampled_token_ids == [[5], [6]] and event.waits == 1
    event2, released2 = _Event(), []
    assert output(event2, released2).get().sampled_token_ids == [[5], [6]]
    assert event2.waits == 1 and released2 == [event2]
