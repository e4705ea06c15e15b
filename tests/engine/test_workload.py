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
        ('{"prompt": "x", "temperature": -1}', "w.jsonl:1: temperature: must be >= 0, got -1"),
        ('{"max_tokens": 3}', "exactly one of prompt"),
        ('{"prompt": "x", "max_tokens": 0}', "w.jsonl:1: max_tokens: must be >= 1"),
        ("[1, 2]", "expected a JSON object"),
        # Types and ranges as vLLM's; NaN / Infinity nowhere (issue 18).
        ('{"prompt": "x", "temperature": "hot"}', "w.jsonl:1: temperature: expected a number"),
        ('{"prompt": "x", "temperature": NaN}', "w.jsonl:1: NaN is not a number JSON allows"),
        ('{"prompt": "x", "temperature": 1e999}', "temperature: must be a finite number"),
        ('{"prompt": "x", "arrival_time_s": Infinity}', "w.jsonl:1: Infinity is not"),
        ('{"prompt": "x", "arrival_time_s": -0.5}', "arrival_time_s: must be >= 0"),
        ('{"prompt": "x", "arrival_time_s": "0.5"}', "arrival_time_s: expected a number"),
        ('{"prompt": "x", "abort_after_s": "soon"}', "w.jsonl:1: abort_after_s: expected a number"),
        ('{"prompt": "x", "abort_after_s": -1e999}', "abort_after_s: must be a finite number"),
        ('{"prompt": 12345}', "w.jsonl:1: prompt: expected a non-empty string"),
        ('{"prompt": [1, "a"]}', "prompt_token_ids: token ids must be integers >= 0"),
        ('{"prompt_token_ids": []}', "prompt_token_ids: is empty"),
        ('{"prompt": "x", "max_tokens": 2.5}', "w.jsonl:1: max_tokens: expected an integer"),
        ('{"prompt": "x", "max_tokens": true}', "max_tokens: expected an integer, got True"),
        ('{"prompt": "x", "seed": 1.5}', "w.jsonl:1: seed: expected an integer"),
        ('{"prompt": "x", "top_k": 2.5}', "top_k: expected an integer"),
        ('{"prompt": "x", "top_k": -2}', "top_k: must be -1 or 0 \\(off\\), or >= 1"),
        ('{"prompt": "x", "top_p": 0}', r"top_p: must be in \(0, 1\]"),
        ('{"prompt": "x", "min_p": 1.5}', r"min_p: must be in \[0, 1\]"),
        ('{"prompt": "x", "presence_penalty": 3}', r"presence_penalty: must be in \[-2, 2\]"),
        ('{"prompt": "x", "repetition_penalty": 0}', "repetition_penalty: must be > 0"),
        ('{"prompt": "x", "stop": [1, 2]}', "w.jsonl:1: stop: expected a string or a list of"),
        ('{"prompt": "x", "stop_token_ids": ["a"]}', "stop_token_ids: token ids must be"),
        ('{"prompt": "x", "ignore_eos": 1}', "ignore_eos: expected true or false"),
        ('{"prompt": "x", "skip_special_tokens": "no"}', "skip_special_tokens: expected true"),
        ('{"prompt": "x", "logprobs": 21}', r"logprobs: must be in \[0, 20\]"),
        ('{"prompt": "x", "id": [1]}', "w.jsonl:1: id: expected a string or an integer"),
        ('{"prompt": "x", "structured": {"regex": 5}}', "structured.regex: expected a string"),
        ('{"prompt": "x", "structured": {"grammar": "a"}}', "structured: expected an object"),
    ],
)
def test_bad_lines(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(WorkloadError, match=message):
        load_workload(str(path))


def test_prompt_as_token_ids_and_text_options(tmp_path):
    path = tmp_path / "w.jsonl"
    row = {"prompt": [4, 5], "skip_special_tokens": False, "include_stop_str_in_output": True}
    path.write_text(json.dumps(row) + "\n")
    (req,) = load_workload(str(path))
    assert req.prompt_token_ids == (4, 5) and req.prompt is None
    assert req.params.skip_special_tokens is False and req.params.include_stop_str_in_output


def test_non_utf8_names_file_line_and_column(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "b\xff"}\n')
    with pytest.raises(WorkloadError, match=r"w.jsonl:2: not UTF-8 \(byte 0xff at column 14\)"):
        load_workload(str(path))
    gpt = tmp_path / "s.json"
    gpt.write_bytes(b'[\n{"conversations": []},\n"\xc3"]')
    with pytest.raises(WorkloadError, match=r"s.json:3: not UTF-8"):
        load_workload(str(gpt))


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([{"conversations": ["hello"]}], "item 0: conversations\\[0\\]: expected an object"),
        ([{"conversations": [{"from": "human", "value": 5}]}], "conversations\\[0\\]"),
        ([{"conversations": "hello"}], "item 0: conversations: expected a list"),
        (["x"], "item 0: expected an object"),
        ([{"id": [1], "conversations": []}], "item 0: id: expected a string"),
    ],
)
def test_bad_sharegpt(tmp_path, items, message):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(items))
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
