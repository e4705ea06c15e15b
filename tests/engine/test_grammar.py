"""Grammar pieces on their own: spec validation, compile errors, per-draft-position mask rows
against a fresh matcher per prefix, termination, the manager's row layout, the lazy import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("xgrammar")

from engine.scheduler.outputs import CachedRequestData, SchedulerOutput  # noqa: E402
from engine.structured.grammar import GrammarCompiler, GrammarError, StructuredSpec  # noqa: E402
from engine.structured.manager import StructuredOutputManager  # noqa: E402
from tests.engine.test_structured_engine import CHOICES, REGEX, SCHEMA, train_tokenizer  # noqa: E402

VOCAB = 320


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Any:
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    return {v for v in range(VOCAB) if (int(bitmask[row, v // 32]) >> (v % 32)) & 1}


def _fresh_allowed(compiler: GrammarCompiler, spec: StructuredSpec, prefix: list[int]) -> set[int]:
    """Reference: a new matcher that accepted ``prefix``, mask filled by xgrammar itself."""
    grammar = compiler.matcher(spec)
    assert grammar.accept(prefix)
    mask = torch.zeros(1, 10, dtype=torch.int32)
    grammar.fill_rows(mask, 0, [])
    return _allowed(mask, 0)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"regex": ""}, "non-empty"),
        ({"choice": []}, "non-empty"),
        ({"choice": ["a", 3]}, "string"),
        ({"json_schema": "x"}, "JSON object"),
        ({"grammar": "root ::= x"}, "kind"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ("regex", "exactly one"),
    ],
)
def test_spec_validation(obj: Any, message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        StructuredSpec.from_dict(obj)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredSpec("regex", "([a-z"), "invalid regex"),
        (StructuredSpec("regex", "a{3,2}"), "invalid regex"),
        (StructuredSpec("json_schema", {"type": "frobnicate"}), "invalid json_schema"),
    ],
)
def test_compile_errors_say_why(
    compiler: GrammarCompiler, spec: StructuredSpec, message: str
) -> None:
    with pytest.raises(GrammarError, match=message):
        compiler.compile(spec)


def test_draft_rows_match_fresh_matchers_and_stop_at_the_first_refused(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    spec = StructuredSpec("json_schema", SCHEMA)
    committed = tokenizer.encode('{"ok": true, "color": "')
    good = tokenizer.encode('red", "n')[:3]
    grammar = compiler.matcher(spec)
    assert grammar.accept(committed)
    refused = next(
        t for t in range(VOCAB) if t not in _fresh_allowed(compiler, spec, committed + good[:1])
    )
    drafts = [good[0], refused, good[1]]  # d_2 is refused: rows 2 and 3 repeat row 1
    bitmask = torch.zeros(4, 10, dtype=torch.int32)
    assert grammar.fill_rows(bitmask, 0, drafts) == 1
    assert _allowed(bitmask, 0) == _fresh_allowed(compiler, spec, committed)
    assert _allowed(bitmask, 1) == _fresh_allowed(compiler, spec, committed + good[:1])
    assert torch.equal(bitmask[2], bitmask[1]) and torch.equal(bitmask[3], bitmask[1])
    assert refused not in _allowed(bitmask, 1)  # verify gives d_2 probability 0 there
    # all drafts allowed: one row per prefix; the walk is rolled back afterwards
    assert grammar.fill_rows(bitmask[:4], 0, good) == 3
    for j in range(4):
        assert _allowed(bitmask, j) == _fresh_allowed(compiler, spec, committed + good[:j])
    assert grammar.accept(good)  # the state was still "after committed" only


def test_choice_terminates_on_eos_only(compiler: GrammarCompiler, tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    grammar = compiler.matcher(StructuredSpec("choice", CHOICES))
    assert not grammar.accept(tokenizer.encode("yesno"))
    grammar = compiler.matcher(StructuredSpec("choice", CHOICES))
    assert grammar.accept(tokenizer.encode("maybe"))
    mask = torch.zeros(1, 10, dtype=torch.int32)
    grammar.fill_rows(mask, 0, [])
    assert _allowed(mask, 0) == {eos}
    assert grammar.accept([eos]) and grammar.is_terminated
    assert grammar.accept([eos])  # EOS after the end (ignore_eos / min_tokens) is fine
    assert not grammar.accept(tokenizer.encode("yes"))
    grammar.fill_rows(mask, 0, [])
    assert _allowed(mask, 0) == {eos}


def test_ids_past_the_tokenizer_are_never_allowed(compiler: GrammarCompiler) -> None:
    mask = torch.zeros(1, 10, dtype=torch.int32)
    compiler.matcher(StructuredSpec("regex", REGEX)).fill_rows(mask, 0, [])
    assert _allowed(mask, 0) and max(_allowed(mask, 0)) < 300


def _step(num_tokens: dict[str, int], drafts: dict[str, list[int]]) -> SchedulerOutput:
    return SchedulerOutput(
        step=3,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens=num_tokens,
        total_num_scheduled_tokens=sum(num_tokens.values()),
        scheduled_spec_decode_tokens=drafts,
    )


def test_manager_rows_follow_the_logits_layout(tokenizer: Any) -> None:
    manager = StructuredOutputManager(tokenizer, VOCAB, [tokenizer.eos_token_id])
    assert manager.add("a", {"choice": CHOICES}) is None
    assert "invalid regex" in (manager.add("bad", {"regex": "(("}) or "")
    assert not manager.is_structured("bad")
    yes = tokenizer.encode("yes")
    manager.note_drafts({"a": yes + [0, 0], "free": [1, 2, 3]})
    so = _step({"free": 3, "a": 3, "gone": 1}, {"free": [-1, -1], "a": [-1, -1]})
    assert manager.needs_mask(so)
    bitmask = manager.build_bitmask(so, lambda shape, dtype: torch.empty(tuple(shape), dtype=dtype))
    assert bitmask.shape == (7, 10)
    assert (bitmask[:3] == -1).all() and (bitmask[6] == -1).all()  # free and unknown rows
    assert _allowed(bitmask, 3) != set(range(VOCAB))  # "a": row per draft position
    manager.remove("a")
    assert not manager.active and not manager.needs_mask(so)


def test_manager_refuses_drafts_it_never_saw(tokenizer: Any) -> None:
    manager = StructuredOutputManager(tokenizer, VOCAB, [tokenizer.eos_token_id])
    manager.add("a", {"regex": REGEX})
    with pytest.raises(RuntimeError, match="drafts"):
        manager.build_bitmask(_step({"a": 2}, {"a": [-1]}), lambda s, d: torch.empty(s, dtype=d))


def test_engine_imports_without_xgrammar() -> None:
    code = (
        "import sys; sys.modules['xgrammar'] = None\n"
        "import engine.core, engine.llm\n"
        "from engine.structured.manager import StructuredOutputManager\n"
        "m = StructuredOutputManager(object(), 64, [0])\n"
        "err = m.add('r', {'regex': 'a+'})\n"
        "assert err is not None and 'xgrammar' in err, err\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
