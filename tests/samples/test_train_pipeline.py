"""The whole training script at toy size on the CPU: it runs, saves loadable models, reports."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from samples.spec_heads import load_head
from samples.train_models import TINY, run
from samples.training import cosine_lr

TOKENIZER = Path(__file__).resolve().parents[2] / "samples" / "tokenizer"


def test_tiny_run_saves_all_models_and_a_report(tmp_path: Path) -> None:
    cfg = replace(TINY, target_max_steps=4, student_max_steps=3, eval_every=2,
                  warmup_steps=2, log_every=2)  # fmt: skip
    report = run(cfg, tmp_path, TOKENIZER, torch.device("cpu"))
    assert set(report["models"]) == {"pycoder-14m", "pycoder-draft-2m", "pycoder-14m-eagle",
                                     "pycoder-14m/mtp"}  # fmt: skip
    assert json.loads((tmp_path / "train_report.json").read_text())["models"] == report["models"]
    for name in ("pycoder-14m", "pycoder-draft-2m"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name, local_files_only=True)
        assert next(model.parameters()).dtype == torch.bfloat16
        assert (tmp_path / name / "tokenizer.json").exists()
    for name in ("pycoder-14m-eagle", "pycoder-14m/mtp"):
        head = load_head(tmp_path / name)
        assert head.cfg.target == "pycoder-14m"
    row = report["models"]["pycoder-14m-eagle"]
    assert 0.0 <= row["agree1"] <= 1.0 and row["steps"] == 3


def test_cosine_schedule_warms_up_then_decays_to_the_floor() -> None:
    values = [cosine_lr(step, 100, 10, 0.1) for step in range(100)]
    assert values[0] == 0.1 and values[9] == 1.0
    assert all(a >= b for a, b in zip(values[10:], values[11:], strict=False))
    assert abs(cosine_lr(100, 100, 10, 0.1) - 0.1) < 1e-12
