"""Structured output end to end on the CPU device: a tiny Qwen3 with a real byte-level BPE tokenizer
(trained here on a few strings), JSON schema / regex / choice requests mixed with free ones.

Every structured output must be valid (json.loads + the schema's constraints, regex fullmatch,
choice membership); async on and off give identical tokens under seeds; an invalid schema or regex
fails only its own request; with n-gram speculation the outputs stay valid and equal greedy
without speculation, and the grammar really does refuse drafts.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("xgrammar")

from engine.llm import LLM, CompletionOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

VOCAB = 320  # model rows; the tokenizer has fewer (ids past it must never be sampled)
EOS = "<|endoftext|>"
CORPUS = [
    '{"ok": true, "color": "red", "n": 42, "name": "bob"}',
    "def add(x, y):\n    return x + y",
    "yes no maybe red green blue",
    "abc-12 xyz-99 [1, 2, 3]",
]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        # not maxLength: xgrammar 0.2.9 lets raw control characters into such strings
        "name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    },
    "required": ["ok", "color", "n", "name"],
}
REGEX = r"[a-z]{3}-\d{2}"
CHOICES = ["yes", "no", "maybe"]
ENGINE = dict(num_kv_blocks=64, block_size=8, max_num_seqs=4, debug_invariants=True)


def train_tokenizer(folder: Path) -> Any:
    """A byte-level BPE tokenizer (~300 ids, EOS = 0) saved as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    hf.save_pretrained(folder)
    return hf


def build_checkpoint(folder: Path) -> str:
    """Tokenizer + a seeded random tiny Qwen3 whose EOS is the tokenizer's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    train_tokenizer(folder)
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=0,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_checkpoint(tmp_path_factory.mktemp("structured"))


def check_schema(value: Any, schema: dict[str, Any]) -> None:
    """The subset of JSON Schema the tests use, checked by hand: object (properties, required,
    no extras), enum, boolean, integer (minimum, maximum), string (pattern)."""
    if "enum" in schema:
        assert value in schema["enum"], value
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict) and set(value) <= set(schema["properties"]), value
        assert set(schema.get("required", ())) <= set(value), value
        for key, item in value.items():
            check_schema(item, schema["properties"][key])
    elif kind == "boolean":
        assert isinstance(value, bool), value
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), value
    elif kind == "string":
        assert isinstance(value, str) and re.search(schema.get("pattern", ""), value), value
    else:
        raise AssertionError(f"schema type {kind!r} not covered by this checker")


def check_valid(llm: LLM, out: CompletionOutput, structured: dict[str, Any]) -> None:
    """Finished by EOS, and the text before it satisfies the request's grammar."""
    assert out.finish_reason == "stop", (out.id, out.finish_reason, out.text)
    text = llm.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
    ((kind, value),) = structured.items()
    if kind == "json_schema":
        check_schema(json.loads(text), value)
    elif kind == "regex":
        assert re.fullmatch(value, text), text
    else:
        assert text in value, text


# Prompts as text; None = a free request.
REQUESTS: list[tuple[str, dict[str, Any] | None]] = [
    ('{"ok":', {"json_schema": SCHEMA}),
    ("code: ", {"regex": REGEX}),
    ("def add(x, y):", None),
    ("answer:", {"choice": CHOICES}),
    ("red green", {"json_schema": SCHEMA}),
    ("broken", {"regex": "([a-z"}),
    ("worse", {"json_schema": {"type": "frobnicate"}}),
    ("xyz-", {"regex": REGEX}),
    ("maybe", None),
]


def _generate(checkpoint: str, params: SamplingParams, **engine: Any) -> list[CompletionOutput]:
    llm = LLM(model=checkpoint, **ENGINE, **engine)
    prompts = [p for p, _ in REQUESTS]
    # free requests ignore EOS: they keep the batch mixed until the end
    free = dataclasses.replace(params, ignore_eos=True)
    per_request = [params if s is not None else free for _, s in REQUESTS]
    outs = llm.generate(prompts, per_request, structured=[s for _, s in REQUESTS])
    for out, (_, spec) in zip(outs, REQUESTS, strict=True):
        if spec is None:
            assert out.finish_reason == "length" and len(out.output_token_ids) == params.max_tokens
        elif out.error is not None:
            assert out.finish_reason == "error" and not out.output_token_ids
        else:
            check_valid(llm, out, spec)
    llm.engine.check_idle()
    llm.close()
    return outs


SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=64)


@pytest.fixture(scope="module")
def sync_outputs(checkpoint) -> list[CompletionOutput]:
    return _generate(checkpoint, SEEDED, async_scheduling=False)


def test_every_structured_output_is_valid_and_invalid_specs_fail_alone(sync_outputs) -> None:
    by_id = {o.id: o for o in sync_outputs}
    failed = {o.id for o in sync_outputs if o.finish_reason == "error"}
    assert failed == {"5", "6"}
    assert "regex" in (by_id["5"].error or "") and "Unclosed" in (by_id["5"].error or "")
    assert "json_schema" in (by_id["6"].error or "")
    assert by_id["6"].to_json()["error"] == by_id["6"].error
    # the structured requests that ran all ended on EOS, the free ones ran to max_tokens
    assert sum(o.finish_reason == "stop" for o in sync_outputs) == 5


@pytest.mark.parametrize("deferred", [True, False])
def test_async_equals_sync_under_seeds(checkpoint, sync_outputs, deferred) -> None:
    outs = _generate(checkpoint, SEEDED, async_scheduling=True, deferred_sampling=deferred)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in sync_outputs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def greedy_outputs(checkpoint) -> list[CompletionOutput]:
    return _generate(checkpoint, GREEDY, async_scheduling=False)


@pytest.mark.parametrize("async_on", [False, True])
def test_ngram_spec_stays_valid_and_equals_greedy(checkpoint, greedy_outputs, async_on) -> None:
    llm_kwargs = dict(async_scheduling=async_on, spec_method="ngram", num_spec_tokens=3)
    checked: dict[str, int] = {}

    original = LLM.close

    def keep_counts(self: LLM) -> None:
        checked["drafts"] = self.engine.structured.num_drafts_checked
        checked["refused"] = self.engine.structured.num_drafts_disallowed
        original(self)

    LLM.close = keep_counts  # type: ignore[method-assign]
    try:
        outs = _generate(checkpoint, GREEDY, **llm_kwargs)
    finally:
        LLM.close = original  # type: ignore[method-assign]
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in greedy_outputs]
    # drafts of structured requests were walked through the grammar, and some were refused
    assert checked["drafts"] > 0 and 0 < checked["refused"] <= checked["drafts"]


def test_without_xgrammar_only_structured_requests_fail(checkpoint, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    llm = LLM(model=checkpoint, **ENGINE, async_scheduling=True)
    outs = llm.generate(["def add", "answer:"], GREEDY, structured=[None, {"choice": CHOICES}])
    llm.close()
    assert outs[0].finish_reason == "length" and len(outs[0].output_token_ids) == 64
    assert outs[1].finish_reason == "error" and "pip install" in (outs[1].error or "")


def test_sample_workload_runs_valid(checkpoint) -> None:
    """samples/workloads/structured.jsonl: mixed structured and free requests, one invalid."""
    from engine.workload import load_jsonl

    path = Path(__file__).resolve().parents[2] / "samples" / "workloads" / "structured.jsonl"
    workload = load_jsonl(str(path))
    llm = LLM(model=checkpoint, **ENGINE, async_scheduling=True)
    outs = llm.run_workload(workload)
    llm.close()
    for w, out in zip(workload, outs, strict=True):
        if w.structured is None:
            assert out.finish_reason in ("stop", "length")
        elif out.finish_reason == "error":
            assert w.id == "invalid-regex" and "Unclosed" in (out.error or "")
        else:
            check_valid(llm, out, w.structured)


def test_model_config_with_a_separate_tokenizer(checkpoint, tmp_path) -> None:
    """``--model-config --random-weights --tokenizer DIR``: structured requests on a shape with no
    checkpoint use that folder's tokenizer and its EOS (the shape's own EOS id, 5 here, belongs
    to another tokenizer); a tokenizer folder without one is a clear error."""
    from engine.config import ConfigError

    shape = json.loads((Path(checkpoint) / "config.json").read_text())
    shape["eos_token_id"] = 5
    (tmp_path / "shape.json").write_text(json.dumps(shape))
    shape_file = str(tmp_path / "shape.json")
    llm = LLM(model_config=shape_file, random_weights=True, seed=3, tokenizer=checkpoint, **ENGINE)
    assert llm.engine.eos_token_ids == (0,)
    prompts, specs = ["code: ", "answer:"], [{"regex": REGEX}, {"choice": CHOICES}]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), structured=specs)
    for out, spec in zip(outs, specs, strict=True):
        check_valid(llm, out, spec)
    llm.close()
    with pytest.raises(ConfigError, match="tokenizer"):
        LLM(model_config=checkpoint, random_weights=True, tokenizer=str(tmp_path), **ENGINE)
    with pytest.raises(ConfigError, match="not a folder"):
        LLM(model_config=checkpoint, random_weights=True, tokenizer=str(tmp_path / "x"), **ENGINE)
