"""Train the sample target, draft model, EAGLE head and MTP module on the stdlib's sources.

On the H200 (about 6 minutes)::

    python -m samples.train_models --out /tmp/models

On the CPU, a toy run of the whole pipeline (seconds)::

    python -m samples.train_models --tiny --out /tmp/tiny_models

Phase 1 trains the target (Qwen3, next-token CE). Phase 2 freezes it (in bf16, as served) and
trains the three proposers together on its outputs: the draft model and both heads distil the
target's next-token distribution; the heads run 2 chained steps (MTP's depth, EAGLE's feature
reuse) so that chaining works. Then every model is saved in bf16 and scored on held-out files:
greedy top-1 agreement with the target, a proxy of the greedy acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from samples.model_shapes import FULL_SHAPES, TINY_SHAPES, draft_config, head_config, target_config
from samples.phases import evaluate, format_table, save_hf, train_students, train_target
from samples.spec_heads import EAGLE_ARCH, MTP_ARCH, EagleHead, MTPModule, save_head
from samples.training import TokenData, tokenize_corpus, val_windows

__all__ = ["TrainConfig", "main"]

TARGET_NAME = "pycoder-14m"
DRAFT_NAME = "pycoder-draft-2m"
EAGLE_NAME = "pycoder-14m-eagle"


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one run; ``*_budget_s=None`` runs exactly ``*_max_steps``."""

    seq_len: int = 512
    batch_size: int = 32
    target_lr: float = 2e-3
    student_lr: float = 2e-3
    weight_decay: float = 0.1
    warmup_steps: int = 100
    target_epochs: float = 5.0  # the stdlib is small (3M tokens without its tests): few epochs
    target_max_steps: int = 3000
    target_budget_s: float | None = 150.0
    student_epochs: float = 8.0
    student_max_steps: int = 3000
    student_budget_s: float | None = 80.0
    eval_every: int = 100  # target: held-out CE this often; the best weights are kept
    monitor_windows: int = 64
    eagle_feature_weight: float = 0.2
    chain_weights: tuple[float, ...] = (1.0, 0.5)
    val_percent: int = 3
    max_val_windows: int = 256
    max_files: int | None = None
    seed: int = 0
    log_every: int = 100
    tiny: bool = False

    def __post_init__(self) -> None:
        if self.seq_len < 4 or self.batch_size < 1:
            raise ValueError("seq_len must be >= 4 and batch_size >= 1")
        if not 0 < self.val_percent < 50:
            raise ValueError(f"val_percent must be in (0, 50), got {self.val_percent}")
        if len(self.chain_weights) < 1:
            raise ValueError("chain_weights needs at least one step")


TINY = TrainConfig(seq_len=64, batch_size=4, warmup_steps=5, target_max_steps=30, eval_every=10,
                   target_budget_s=None, student_max_steps=20, student_budget_s=None,
                   val_percent=20, max_val_windows=8, max_files=40, log_every=10,
                   tiny=True)  # fmt: skip


def _seed_all(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


Row = dict[str, float]
# role in the report -> folder under --out
FOLDERS = {"target": TARGET_NAME, "draft": DRAFT_NAME, "eagle": EAGLE_NAME,
           "mtp": f"{TARGET_NAME}/mtp"}  # fmt: skip


def run(
    cfg: TrainConfig, out_dir: Path, tokenizer_dir: Path, device: torch.device
) -> dict[str, Any]:
    """Train, save and score all four models; returns the report (also ``train_report.json``)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    _seed_all(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    started = time.perf_counter()
    data: TokenData = tokenize_corpus(tokenizer_dir / "tokenizer.json", 0, cfg.val_percent,
                                      cfg.max_files)  # fmt: skip
    vocab_size = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    print(f"corpus: {data.train.numel()} train tokens ({data.num_train_files} files), "
          f"{data.val.numel()} val tokens ({data.num_val_files} files), vocab {vocab_size}, "
          f"{time.perf_counter() - started:.1f}s", flush=True)  # fmt: skip
    train_stream = data.train.to(device)
    target_shape, draft_shape = TINY_SHAPES if cfg.tiny else FULL_SHAPES

    target = AutoModelForCausalLM.from_config(target_config(target_shape, vocab_size)).to(device)
    monitor = val_windows(data.val, cfg.seq_len, cfg.monitor_windows).to(device)
    stats = {"target": train_target(target, train_stream, monitor, cfg, device)}
    target = target.to(torch.bfloat16).eval().requires_grad_(False)
    save_hf(target, out_dir / TARGET_NAME, tokenizer_dir)

    draft = AutoModelForCausalLM.from_config(draft_config(draft_shape, vocab_size)).to(device)
    eagle = EagleHead(head_config(EAGLE_ARCH, target_shape, vocab_size, TARGET_NAME)).to(device)
    mtp = MTPModule(head_config(MTP_ARCH, target_shape, vocab_size, TARGET_NAME)).to(device)
    stats.update(train_students(target, draft, eagle, mtp, train_stream, cfg, device))
    draft, eagle, mtp = draft.to(torch.bfloat16), eagle.to(torch.bfloat16), mtp.to(torch.bfloat16)
    save_hf(draft, out_dir / DRAFT_NAME, tokenizer_dir)
    save_head(eagle, out_dir / EAGLE_NAME)
    save_head(mtp, out_dir / FOLDERS["mtp"])

    windows = val_windows(data.val, cfg.seq_len, cfg.max_val_windows)
    scores = evaluate(target, draft, eagle, mtp, windows, cfg.batch_size, device)
    modules = {"target": target, "draft": draft, "eagle": eagle, "mtp": mtp}
    rows = {FOLDERS[role]: {"params": float(sum(p.numel() for p in module.parameters())),
                            **stats[role], **scores[role]}
            for role, module in modules.items()}  # fmt: skip
    report = {
        "config": asdict(cfg),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "corpus": {
            "train_tokens": data.train.numel(),
            "val_tokens": data.val.numel(),
            "val_windows": int(windows.shape[0]),
        },  # fmt: skip
        "models": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (out_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(rows), flush=True)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("samples/models"))
    parser.add_argument("--tokenizer", type=Path, default=Path("samples/tokenizer"))
    parser.add_argument("--tiny", action="store_true", help="toy shapes and steps (CPU check)")
    parser.add_argument("--target-steps", type=int, help="exact steps (no time budget)")
    parser.add_argument("--student-steps", type=int, help="exact steps (no time budget)")
    parser.add_argument("--target-budget-s", type=float)
    parser.add_argument("--student-budget-s", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    cfg = replace(TINY if args.tiny else TrainConfig(), seed=args.seed)
    if args.target_budget_s is not None:
        cfg = replace(cfg, target_budget_s=args.target_budget_s)
    if args.student_budget_s is not None:
        cfg = replace(cfg, student_budget_s=args.student_budget_s)
    if args.target_steps is not None:
        cfg = replace(cfg, target_max_steps=args.target_steps, target_budget_s=None)
    if args.student_steps is not None:
        cfg = replace(cfg, student_max_steps=args.student_steps, student_budget_s=None)
    run(cfg, args.out, args.tokenizer, torch.device(args.device))


if __name__ == "__main__":
    main()
