"""The training phases (target; the three proposers on the frozen target), scoring and saving."""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from samples.spec_heads import EagleHead, MTPModule
from samples.spec_training import (
    Agreement,
    TargetOutputs,
    chained_head_loss,
    draft_agreement,
    head_agreement,
    soft_cross_entropy,
)
from samples.training import StepBudget, cosine_lr, make_optimizer, sample_batch

if TYPE_CHECKING:
    from samples.train_models import TrainConfig

__all__ = ["train_target", "train_students", "evaluate", "save_hf", "format_table"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LossFn = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def _autocast(device: torch.device) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _run_phase(
    name: str,
    seed_offset: int,
    params: list[torch.nn.Parameter],
    loss_fn: LossFn,
    stream: torch.Tensor,
    cfg: TrainConfig,
    lr: float,
    max_steps: int,
    budget_s: float | None,
    device: torch.device,
    monitor: Callable[[], float] | None = None,
) -> dict[str, dict[str, float]]:
    """AdamW + cosine over seeded random windows; ``loss_fn(batch)['total']`` is minimised.

    With ``monitor`` (a held-out loss), it is measured every ``cfg.eval_every`` steps and at the
    end, and the parameters of the best measurement are restored (early stopping).
    Returns per loss name: ``train_loss`` (mean over the last logging window), ``steps``,
    ``train_tokens``; with ``monitor`` also ``best_step`` and ``monitor_loss``.
    """
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + seed_offset)
    optimizer = make_optimizer([(params, lr)], cfg.weight_decay)
    budget = StepBudget(max_steps, budget_s)
    recent: list[dict[str, torch.Tensor]] = []
    means: dict[str, float] = {}
    step, started = 0, time.perf_counter()
    best = _BestParams(params)
    while step < budget.horizon():
        scale = cosine_lr(step, budget.horizon(), cfg.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = group["peak_lr"] * scale
        batch = sample_batch(stream, cfg.batch_size, cfg.seq_len, generator)  # [B, T+1]
        losses = loss_fn(batch)
        losses["total"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        budget.tick(step, device)
        recent.append({k: v.detach() for k, v in losses.items()})
        step += 1
        if step % cfg.log_every == 0 or step >= budget.horizon():
            means = {k: torch.stack([r[k] for r in recent]).mean().item() for k in recent[0]}
            recent.clear()
            shown = " ".join(f"{k} {v:.3f}" for k, v in means.items())
            print(f"  {name} step {step}/{budget.horizon()} lr {lr * scale:.2e} {shown} "
                  f"({time.perf_counter() - started:.0f}s)", flush=True)  # fmt: skip
        if monitor is not None and (step % cfg.eval_every == 0 or step >= budget.horizon()):
            best.offer(step, monitor())
    tokens = step * cfg.batch_size * cfg.seq_len
    extra = best.restore() if monitor is not None else {}
    return {k: {"train_loss": v, "steps": step, "train_tokens": tokens, **extra}
            for k, v in means.items()}  # fmt: skip


class _BestParams:
    """A copy of the parameters at the lowest monitored loss."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.best_loss, self.best_step = float("inf"), -1
        self.copy: list[torch.Tensor] = []

    def offer(self, step: int, loss: float) -> None:
        print(f"    held-out CE {loss:.4f} at step {step}", flush=True)
        if loss < self.best_loss:
            self.best_loss, self.best_step = loss, step
            self.copy = [p.detach().clone() for p in self.params]

    def restore(self) -> dict[str, float]:
        with torch.no_grad():
            for param, saved in zip(self.params, self.copy, strict=True):
                param.copy_(saved)
        print(f"  kept step {self.best_step} (held-out CE {self.best_loss:.4f})", flush=True)
        return {"best_step": self.best_step, "monitor_loss": self.best_loss}


def _max_steps(epochs: float, cap: int, stream: torch.Tensor, cfg: TrainConfig) -> int:
    return max(1, min(cap, math.ceil(epochs * stream.numel() / (cfg.batch_size * cfg.seq_len))))


def train_target(
    target: torch.nn.Module,
    stream: torch.Tensor,
    monitor_windows: torch.Tensor,
    cfg: TrainConfig,
    device: torch.device,
) -> dict[str, float]:
    """Next-token cross-entropy on the corpus, keeping the weights of the best held-out CE
    on ``monitor_windows: [n, T+1]``."""

    @torch.no_grad()
    def monitor() -> float:
        target.eval()
        loss = loss_fn(monitor_windows)["total"].item()
        target.train()
        return loss

    def loss_fn(batch: torch.Tensor) -> dict[str, torch.Tensor]:
        with _autocast(device):
            logits = target(input_ids=batch[:, :-1], use_cache=False).logits  # [B, T, V]
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        return {"total": loss}

    target.train()
    print(f"phase 1: target, {sum(p.numel() for p in target.parameters())} params", flush=True)
    max_steps = _max_steps(cfg.target_epochs, cfg.target_max_steps, stream, cfg)
    stats = _run_phase("target", 1, list(target.parameters()), loss_fn, stream, cfg,
                       cfg.target_lr, max_steps, cfg.target_budget_s, device, monitor)  # fmt: skip
    return stats["total"]


@torch.no_grad()
def target_outputs(target: Any, tokens: torch.Tensor, device: torch.device) -> TargetOutputs:
    """Embeddings, post-norm hidden states and next-token probabilities of the frozen target."""
    with _autocast(device):
        hidden = target.model(input_ids=tokens, use_cache=False).last_hidden_state  # [B, T, H]
        logits = target.lm_head(hidden)  # [B, T, V]
    return TargetOutputs(
        embeds=target.model.embed_tokens(tokens),
        hidden=hidden,
        probs=torch.softmax(logits.float(), dim=-1),
    )


def train_students(
    target: Any,
    draft: Any,
    eagle: EagleHead,
    mtp: MTPModule,
    stream: torch.Tensor,
    cfg: TrainConfig,
    device: torch.device,
) -> dict[str, dict[str, float]]:
    """Distil the frozen target into the draft model, the EAGLE head and the MTP module at once
    (one target forward per batch; disjoint parameters, so the summed loss trains each alone)."""

    def loss_fn(batch: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = batch[:, :-1]
        teacher = target_outputs(target, tokens, device)
        with _autocast(device):
            draft_logits = draft(input_ids=tokens, use_cache=False).logits  # [B, T, V]
            losses = {
                "draft": soft_cross_entropy(draft_logits, teacher.probs),
                "eagle": chained_head_loss(
                    eagle, target.lm_head, teacher, cfg.chain_weights, cfg.eagle_feature_weight
                ),  # fmt: skip
                "mtp": chained_head_loss(mtp, target.lm_head, teacher, cfg.chain_weights, 0.0),
            }
        return {"total": losses["draft"] + losses["eagle"] + losses["mtp"], **losses}

    for module in (draft, eagle, mtp):
        module.train()
    params = [p for m in (draft, eagle, mtp) for p in m.parameters()]
    print("phase 2: draft + eagle + mtp on the frozen bf16 target", flush=True)
    max_steps = _max_steps(cfg.student_epochs, cfg.student_max_steps, stream, cfg)
    return _run_phase("students", 2, params, loss_fn, stream, cfg, cfg.student_lr,
                      max_steps, cfg.student_budget_s, device)  # fmt: skip


@torch.no_grad()
def evaluate(
    target: Any,
    draft: Any,
    eagle: EagleHead,
    mtp: MTPModule,
    windows: torch.Tensor,
    batch_size: int,
    device: torch.device,
) -> dict[str, dict[str, float]]:
    """Held-out CE and greedy agreement with the target (all models as saved, in bf16).

    ``windows: [N, T+1]``; only the first ``T`` tokens of each are fed.
    """
    for module in (target, draft, eagle, mtp):
        module.eval()
    results = {name: Agreement() for name in ("draft", "eagle", "mtp")}
    target_ce, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        tokens = windows[start : start + batch_size, :-1].to(device)  # [b, T]
        teacher = target_outputs(target, tokens, device)
        logp = teacher.probs[:, :-1].clamp_min(1e-30).log().flatten(0, 1)
        target_ce += F.nll_loss(logp, tokens[:, 1:].flatten(), reduction="sum").item()
        count += tokens[:, 1:].numel()
        draft_logits = draft(input_ids=tokens, use_cache=False).logits
        draft_agreement(draft_logits, teacher, tokens, results["draft"])
        head_agreement(eagle, target.lm_head, teacher, tokens, results["eagle"])
        head_agreement(mtp, target.lm_head, teacher, tokens, results["mtp"])
    scores: dict[str, dict[str, float]] = {k: v.summary() for k, v in results.items()}
    scores["target"] = {"val_ce": target_ce / max(1, count)}
    return scores


def save_hf(model: Any, out_dir: Path, tokenizer_dir: Path) -> None:
    """``save_pretrained`` in the model's dtype, plus the tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)


def format_table(models: dict[str, dict[str, float]]) -> str:
    """The report's models as a fixed-width table (agreement columns blank for the target)."""
    cols = ("params", "steps", "train_tokens", "train_loss", "val_ce", "agree1", "agree2",
            "accepted_of_2")  # fmt: skip
    lines = [f"{'model':<20}" + "".join(f"{c:>14}" for c in cols)]
    for name, row in models.items():
        cells = []
        for col in cols:
            value = row.get(col)
            if value is None:
                cells.append(f"{'-':>14}")
            elif isinstance(value, float) and col not in ("params", "steps", "train_tokens"):
                cells.append(f"{value:>14.4f}")
            else:
                cells.append(f"{int(value):>14,}")
        lines.append(f"{name:<20}" + "".join(cells))
    return "\n".join(lines)
