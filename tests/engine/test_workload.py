"""Workload loaders: vLLM parameter names, ShareGPT, synthetic; bad input is a clear error."""

from __future__ import annotations

import json

import pytest

from engine.workload import WorkloadError, load_workload, parse_synthetic


def test_jsonl_with_vllm_names(tmp_path):
    path = tmp_path / "w.jsonl"
    rows = [
        {
            "id": "b",
            "prompt": "hello",
            "max_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "min_p": 0.1,
            "seed": 3,
            "stop": "\n",
            "stop_token_ids": [2],
            "ignore_eos": True,
            "logprobs": 2,
            "arrival_time_s": 0.5,
        },
        {"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 2},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = load_workload(str(path))
    assert [r.id for r in reqs] == ["a", "b"]  # sorted by arrival
    b = reqs[1]
    assert b.params.stop == ("\n",) and b.params.stop_token_ids == (2,) and b.params.top_k == 5
    assert b.arrival_time_s == 0.5 and reqs[0].prompt_token_ids == (1, 2, 3)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "w.jsonl:1: not JSON"),
        ('{"prompt": "x", "temprature": 1}', "unknown field"),
        ('{"prompt": "x", "temperature": -1}', "temperature must be >= 0"),
        ('{"max_tokens": 3}', "exactly one of prompt"),
        ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be >= 1"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_lines(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(WorkloadError, match=message):
        load_workload(str(path))


def test_duplicate_ids_and_missing_file(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"id": "x", "prompt": "a"}\n{"id": "x", "prompt": "b"}\n')
    with pytest.raises(WorkloadError, match="duplicate request id 'x'"):
        load_workload(str(path))
    with pytest.raises(WorkloadError, match="not found"):
        load_workload(str(tmp_path / "nope.jsonl"))


def test_sharegpt(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(
        json.dumps(
            [
                {
                    "id": "c1",
                    "conversations": [
                        {"from": "human", "value": "hi there"},
                        {"from": "gpt", "value": "one two three"},
                    ],
                },
                {"id": "c2", "conversations": []},
            ]
        )
    )
    reqs = load_workload(str(path))
    assert len(reqs) == 1 and reqs[0].prompt == "hi there" and reqs[0].params.max_tokens == 3


def test_synthetic_is_seeded_and_shaped():
    spec = "synthetic:n=20,in=4-8,out=2-3,rate=50,vocab=100,prefix=5,seed=1"
    a, b = load_workload(spec), load_workload(spec)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(9 <= len(r.prompt_token_ids) <= 13 for r in a)
    assert len({r.prompt_token_ids[:5] for r in a}) == 1  # the shared prefix
    arrivals = [r.arrival_time_s for r in a]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    with pytest.raises(WorkloadError, match="unknown key"):
        parse_synthetic("synthetic:q=1")
