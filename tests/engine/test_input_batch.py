"""build_input_batch against its definition: per-request fields, batch-wide sampling switches and
the packed int32 layout, for mixes of sampling params, drafts, mid-prefill chunks and padding."""

from __future__ import annotations

import numpy as np
import pytest

from engine.device import CpuDevice
from engine.runner.input_batch import build_input_batch
from engine.runner.states import RequestStates
from engine.sampling_params import SamplingParams
from engine.scheduler.outputs import SchedulerOutput
from tests.engine.runner_harness import new_req, step_output

GREEDY = SamplingParams(temperature=0.0)
RANDOM = SamplingParams(temperature=0.8)
PENALISED = SamplingParams(temperature=0.0, repetition_penalty=1.2)
TOP_K = SamplingParams(temperature=0.0, top_k=5)
LOGPROBS_3 = SamplingParams(temperature=0.0, logprobs=3)
LOGPROBS_0 = SamplingParams(temperature=0.0, logprobs=0)


@pytest.fixture
def device():
    dev = CpuDevice()
    yield dev
    dev.close()


def _states(device: CpuDevice) -> RequestStates:
    return RequestStates(
        device, max_num_reqs=8, max_model_len=64, max_blocks_per_req=16, vocab_size=97
    )


def _expected_switches(params: list[SamplingParams]) -> dict[str, object]:
    """The batch-wide sampling switches, straight from the definition."""
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    return dict(
        any_penalties=any(p.has_penalties for p in params),
        all_greedy=all(p.is_greedy for p in params),
        no_top_k_top_p_min_p=all(
            p.top_k <= 0 and p.top_p == 1.0 and p.min_p == 0.0 for p in params
        ),
        max_num_logprobs=max(wanted) if wanted else None,
    )


def _expected_packed(
    rows: list[int],
    query_lens: list[int],
    num_logits: list[int],
    returns: list[bool],
    num_blocks: list[int],
    trash_row: int,
    pad: int,
) -> np.ndarray:
    """The packed layout of input_batch's module docstring, built with numpy."""
    commit = [r if ok else trash_row for r, ok in zip(rows, returns, strict=True)]
    sections = [
        rows + [trash_row] * pad,
        np.cumsum([0, *query_lens, *([0] * pad)]),
        np.cumsum([0, *num_logits]),
        np.repeat(rows, num_logits),
        np.repeat(commit, num_logits),
        num_blocks,
    ]
    return np.concatenate([np.asarray(s, np.int64) for s in sections]).astype(np.int32)


@pytest.mark.parametrize(
    ("params", "drafts", "pad"),
    [
        ([GREEDY, GREEDY, GREEDY], {}, 0),
        ([GREEDY, RANDOM, GREEDY], {}, 0),
        ([PENALISED, GREEDY, TOP_K], {}, 0),
        ([LOGPROBS_0, GREEDY, LOGPROBS_3], {}, 0),
        ([GREEDY, GREEDY, GREEDY], {}, 5),  # padded for a CUDA graph
        ([GREEDY, RANDOM, GREEDY], {"b": [-1, -1], "c": [-1]}, 0),  # drafts to verify
    ],
)
def test_batch_matches_definition(
    device: CpuDevice, params: list[SamplingParams], drafts: dict[str, list[int]], pad: int
) -> None:
    states = _states(device)
    # "a" is mid-prefill (its chunk ends before its prompt does); "b" and "c" decode.
    prompts = {"a": list(range(2, 12)), "b": [3, 4, 5], "c": [6, 7]}
    blocks = {"a": [1, 2, 3], "b": [4], "c": [5, 6]}
    for (req_id, prompt), p in zip(prompts.items(), params, strict=True):
        states.add(new_req(req_id, prompt, blocks[req_id], params=p))
    tokens = {"a": 4, "b": 3 + len(drafts.get("b", [])), "c": 2 + len(drafts.get("c", []))}
    out = step_output(0, tokens=tokens)
    out = SchedulerOutput(
        out.step,
        out.scheduled_new_reqs,
        out.scheduled_cached_reqs,
        out.num_scheduled_tokens,
        out.total_num_scheduled_tokens,
        scheduled_spec_decode_tokens=drafts,
    )
    num_reqs = len(tokens)
    batch, packed = build_input_batch(out, states, num_reqs + pad if pad else None)

    rows = [states.row_of[r] for r in tokens]
    num_logits = [1 + len(drafts.get(r, [])) for r in tokens]
    returns = [False, True, True]
    assert batch.rows == rows and batch.query_lens == list(tokens.values())
    assert batch.num_logits_per_req == num_logits and batch.returns_tokens == returns
    assert batch.num_drafts == sum(num_logits) - num_reqs
    assert batch.max_seq_len == max(tokens.values()) and batch.num_padded_reqs == num_reqs + pad
    assert not batch.is_uniform_decode
    switches = _expected_switches(params)
    assert {name: getattr(batch, name) for name in switches} == switches
    expected = _expected_packed(
        rows, list(tokens.values()), num_logits, returns, [3, 1, 2], states.trash_row, pad
    )
    assert packed.dtype == np.int32
    np.testing.assert_array_equal(packed, expected)
    # The frontier mirrors advanced by the scheduled tokens.
    assert [int(states.num_computed_cpu[r]) for r in rows] == list(tokens.values())


def test_freed_rows_stop_counting_for_the_switches(device: CpuDevice) -> None:
    states = _states(device)
    states.add(new_req("g", [1, 2], [1], params=GREEDY))
    states.add(new_req("r", [1, 2], [2], params=SamplingParams(temperature=0.5, logprobs=2)))
    batch, _ = build_input_batch(step_output(0, tokens={"g": 2, "r": 2}), states)
    assert not batch.all_greedy and batch.max_num_logprobs == 2
    # Only the greedy request is scheduled: its own switches, though "r" still holds a row.
    batch, _ = build_input_batch(step_output(1, tokens={"g": 1}), states)
    assert batch.all_greedy and batch.max_num_logprobs is None
    states.apply(states.flush())  # a step ran: the freed row may be written again
    states.remove(["r"])
    states.add(new_req("r2", [1, 2], [3], params=GREEDY))  # reuses the freed row
    assert states.row_of["r2"] == 1
    batch, _ = build_input_batch(step_output(2, tokens={"g": 1, "r2": 2}), states)
    assert batch.all_greedy and batch.no_top_k_top_p_min_p and batch.max_num_logprobs is None


def test_update_cached_stages_only_disagreeing_frontiers(device: CpuDevice) -> None:
    states = _states(device)
    for req_id in "ab":
        states.add(new_req(req_id, [1, 2, 3], [1]))
    build_input_batch(step_output(0, tokens={"a": 3, "b": 3}), states)
    states.num_computed.flush()  # drop what add staged
    states.update_cached(step_output(1, cached=[("a", [], 3), ("b", [], 2)]).scheduled_cached_reqs)
    flush = states.num_computed.flush()
    assert flush is not None and flush.num_writes == 1  # only "b" disagreed
    assert [int(states.num_computed_cpu[states.row_of[r]]) for r in "ab"] == [3, 2]


def test_too_long_a_sequence_is_refused(device: CpuDevice) -> None:
    states = _states(device)
    states.add(new_req("a", list(range(60)), [1]))
    with pytest.raises(ValueError, match="max_model_len"):
        build_input_batch(step_output(0, tokens={"a": 65}), states)


def test_token_bucket_pads_tokens_and_requests(device: CpuDevice) -> None:
    """A mixed-step graph's shape (docs/design.md §2.6): tokens padded to the bucket, requests to
    its request count; padded requests own no token (their query_start_loc entries repeat the
    total) and map to the trash row. A shape the batch does not fit is refused before any
    mirror moves."""
    states = _states(device)
    states.add(new_req("a", list(range(2, 9)), [1, 2]))
    states.add(new_req("b", [3, 4, 5], [3]))
    out = step_output(0, tokens={"a": 7, "b": 3})
    with pytest.raises(ValueError, match="does not fit its padded shape"):
        build_input_batch(out, states, 4, 8)
    with pytest.raises(ValueError, match="does not fit its padded shape"):
        build_input_batch(out, states, 1, 16)
    assert int(states.num_computed_cpu[states.row_of["a"]]) == 0  # nothing advanced
    batch, packed = build_input_batch(out, states, 4, 16)
    assert (batch.num_tokens, batch.num_padded_tokens) == (10, 16)
    assert (batch.num_reqs, batch.num_padded_reqs) == (2, 4)
    start, end = batch.offsets["query_start_loc"]
    np.testing.assert_array_equal(packed[start:end], [0, 7, 10, 10, 10])
    start, end = batch.offsets["idx_mapping"]
    trash = states.trash_row
    np.testing.assert_array_equal(packed[start:end], [states.row_of["a"], states.row_of["b"],
                                                      trash, trash])  # fmt: skip
