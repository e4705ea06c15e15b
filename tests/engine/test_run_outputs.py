"""Outputs that survive, refusals instead of silent truncation, start-up checks, vLLM's text.

Real engine runs on the tiny checkpoint (CPU); the text tests use the sample model's tokenizer.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.cli import run_main
from engine.config import ConfigError, EngineConfig
from engine.engine_parts import check_state_fits, estimate_state_bytes
from engine.llm import LLM, CompletionOutput
from engine.sampling_params import SamplingParams
from engine.workload import WorkloadError, WorkloadRequest

ROOT = Path(__file__).resolve().parents[2]
_GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _req(rid: str, arrival: float = 0.0, structured: dict | None = None, n: int = 4):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return WorkloadRequest(rid, None, (5, 6, 7), params, arrival, structured=structured)


@pytest.fixture(scope="module")
def llm(tiny_hf_checkpoint):
    engine = LLM(model=tiny_hf_checkpoint, num_kv_blocks=8, block_size=16, max_num_seqs=4)
    yield engine
    engine.close()


def test_last_request_rejected_while_idle(llm):
    """Issue 18: a rejected last arrival with nothing running crashed with IndexError."""
    finished: list[CompletionOutput] = []
    # No tokenizer in the tiny checkpoint: a structured request is rejected on arrival.
    w = [_req("ok"), _req("bad", arrival=0.2, structured={"regex": "[a-z]+"})]
    outs = llm.run_workload(w, on_finish=finished.append)
    assert [o.id for o in outs] == ["ok", "bad"]  # workload order
    assert [o.id for o in finished] == ["ok", "bad"]  # finish order, streamed
    assert outs[0].finish_reason == "length" and len(outs[0].output_token_ids) == 4
    assert outs[1].finish_reason == "error" and outs[1].error and outs[1].output_token_ids == []
    llm.engine.check_idle()


def test_every_request_rejected(llm):
    w = [_req(f"bad{i}", arrival=0.01 * i, structured={"choice": ["a"]}) for i in range(3)]
    outs = llm.run_workload(w)
    assert [o.finish_reason for o in outs] == ["error"] * 3
    assert all(json.loads(json.dumps(o.to_json()))["error"] for o in outs)
    llm.engine.check_idle()


def test_stop_aborts_in_flight_and_skips_unarrived(llm):
    steps = {"n": 0}

    def should_stop() -> bool:
        steps["n"] += 1
        return steps["n"] > 6

    w = [_req("a", n=3), _req("long", n=90), _req("never", arrival=30.0)]
    finished: list[CompletionOutput] = []
    outs = llm.run_workload(w, on_finish=finished.append, should_stop=should_stop)
    by_id = {o.id: o for o in outs}
    assert set(by_id) == {"a", "long"}  # "never" never arrived
    assert by_id["a"].finish_reason == "length" and len(by_id["a"].output_token_ids) == 3
    assert by_id["long"].finish_reason == "abort"
    assert 0 < len(by_id["long"].output_token_ids) < 90
    assert sorted(o.id for o in finished) == ["a", "long"]
    llm.engine.check_idle()


def test_max_tokens_beyond_max_model_len_refused(llm):
    """8 blocks x 16 = max_model_len 128: 3 + 126 does not fit; nothing runs (as vLLM's server)."""
    assert llm.engine.max_model_len == 128
    w = [_req("fits", n=125), _req("too-long", n=126)]
    with pytest.raises(ConfigError, match=r"'too-long' \(3 prompt \+ 126 max_tokens\)"):
        llm.run_workload(w)
    llm.engine.check_idle()
    (out,) = llm.run_workload(w[:1])  # exactly fits: gets all its tokens
    assert len(out.output_token_ids) == 125 and out.finish_reason == "length"


def test_small_pool_is_said_at_start(tiny_hf_checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="stepscope.engine"):
        LLM(model=tiny_hf_checkpoint, num_kv_blocks=2, block_size=16).close()
    assert "max_model_len is 32" in caplog.text and "max_position_embeddings=512" in caplog.text


def test_state_estimate_matches_allocations(llm):
    """The KV part of the estimate is exact (sum of the KV tensors' bytes)."""
    config = llm.config
    need = estimate_state_bytes(config, llm.engine.model_config, llm.engine.max_model_len)
    kv = sum(t.numel() * t.element_size() for t in llm.engine.runner.fwd.kv_caches)
    assert need["kv_cache"] == kv
    token_ids = llm.engine.runner.states.token_ids.gpu
    assert need["request_state"] >= token_ids.numel() * token_ids.element_size()


def test_state_that_cannot_fit_is_refused(llm):
    huge = EngineConfig.from_flat(model="x", num_kv_blocks=10**10, block_size=16, max_num_seqs=64)
    with pytest.raises(
        ConfigError, match=r"does not fit: at least .* GiB needed .*10000000000 blocks"
    ):
        check_state_fits(huge, llm.engine.model_config, 2048, llm.engine.device)
    rows = EngineConfig.from_flat(model="x", max_num_seqs=10**9)
    with pytest.raises(ConfigError, match="1000000000 seqs"):
        check_state_fits(rows, llm.engine.model_config, 512, llm.engine.device)


def test_api_requests_refuse_nan():
    for field in ("arrival_time_s", "abort_after_s"):
        with pytest.raises(WorkloadError, match=f"{field}: must be a finite number"):
            WorkloadRequest("x", "hi", None, _GREEDY, **{field: math.nan})
    with pytest.raises(ValueError, match="temperature: must be a finite number"):
        SamplingParams(temperature=math.inf)


# ---- the command line: --output ----------------------------------------------------------


def test_output_folder_missing_fails_at_once(tmp_path, capsys):
    start = time.monotonic()
    code = run_main(
        ["--model", "no-such-model", "--workload", "synthetic:n=2", "--output",
         str(tmp_path / "missing" / "out.jsonl")]
    )  # fmt: skip
    assert code == 2 and time.monotonic() - start < 5  # before any model is loaded
    assert "folder" in capsys.readouterr().err


def test_output_file_complete_in_workload_order(tiny_hf_checkpoint, tmp_path):
    # Arrivals out of id order; short ones finish first: the file is still in workload order.
    rows = [
        {"id": "late-long", "prompt_token_ids": [9, 8], "max_tokens": 12, "arrival_time_s": 0.0},
        {"id": "early-short", "prompt_token_ids": [7], "max_tokens": 1, "arrival_time_s": 0.05},
        {"id": "bad", "prompt_token_ids": [7], "structured": {"regex": "a"}},
    ]
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({**r, "ignore_eos": True}) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    code = run_main(
        ["--model", tiny_hf_checkpoint, "--workload", str(workload), "--output", str(out),
         "--no-progress", "--num-kv-blocks", "16"]
    )  # fmt: skip
    assert code == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    # load_workload sorts by arrival (stable): that is the workload's order.
    assert [x["id"] for x in lines] == ["late-long", "bad", "early-short"]
    assert [x["finish_reason"] for x in lines] == ["length", "error", "length"]
    assert len(lines[0]["output_token_ids"]) == 12 and "error" in lines[1]
    assert not (tmp_path / "out.jsonl.tmp").exists()


# ---- vLLM's output text ------------------------------------------------------------------


@pytest.fixture(scope="module")
def detok():
    from engine.model.loader import load_tokenizer

    tok = load_tokenizer(ROOT / "samples/models/pycoder-14m")
    return SimpleNamespace(tokenizer=tok), tok


def _text(detok, ids, reason, stop=None, **params) -> str:
    owner, _ = detok
    out = CompletionOutput("x", 1, list(ids), finish_reason=reason, stop_reason=stop)
    LLM._finish_text(owner, out, SamplingParams(**params))  # type: ignore[arg-type]
    return out.text or ""


def test_text_defaults_as_vllm(detok):
    _, tok = detok
    body = tok.encode("gamma delta")
    eos = tok.eos_token_id
    assert tok.decode(body + [eos]).endswith("<|endoftext|>")  # the raw decode
    assert _text(detok, body + [eos], "stop") == "gamma delta"  # EOS: not in the text
    assert _text(detok, body + [eos], "length") == "gamma delta"  # special tokens skipped
    kept = _text(detok, body + [eos], "length", skip_special_tokens=False)
    assert kept == "gamma delta<|endoftext|>"
    assert _text(detok, body + [eos], "stop", include_stop_str_in_output=True) == "gamma delta"
    with_stop = _text(
        detok, body + [eos], "stop", include_stop_str_in_output=True, skip_special_tokens=False
    )
    assert with_stop == "gamma delta<|endoftext|>"
    # A stop string: the text ends before it (or after it, when asked); the ids keep it all.
    ids = tok.encode("a = 1\nb = 2")
    assert _text(detok, ids, "stop", stop="\nb") == "a = 1"
    assert _text(detok, ids, "stop", stop="\nb", include_stop_str_in_output=True) == "a = 1\nb"
    assert _text(detok, ids, "abort") == "a = 1\nb = 2"  # partial output: all of it


# ---- --help without torch ----------------------------------------------------------------


def test_help_imports_no_torch():
    """``stepscope --help`` and ``stepscope run --help`` parse before torch is imported
    (measured on a 2-core CPU: 5.4 s -> 0.5 s for ``run --help``)."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\n"
        "from stepscope.cli import main\n"
        "for argv in (['--help'], ['run', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    assert 'usage' in out.getvalue(), argv\n"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))\n"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
