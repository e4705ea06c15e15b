"""The fixed world every fuzz scenario runs in: one tokenizer, one tiny target, three drafts.

Built once per process (``world()``), then shared: models keep no per-engine state (the KV cache
lives in the runner), so each scenario's ``EngineCore`` takes them from here instead of building
its own (:func:`cached_models`). Everything is seeded; nothing is downloaded.

Drafts of three kinds give acceptance rates from all to almost none: ``fuzz:draft-self`` is the
target itself (every greedy draft accepted), ``fuzz:draft-near`` the target with noise added to
every matrix (some accepted), ``fuzz:draft-far`` an independent 1-layer model (few accepted).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from engine.device import CpuDevice, CpuStream
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM

__all__ = ["World", "world", "cached_models", "InlineCpuDevice", "DRAFTS", "HAS_XGRAMMAR"]

EOS_TEXT = "<|endoftext|>"
CORPUS = [
    '{"ok": true, "color": "red", "n": 42}',
    "yes no maybe red green blue",
    "abc-12 xyz-99 [1, 2, 3] stop here.",
]
DRAFTS = ("fuzz:draft-self", "fuzz:draft-near", "fuzz:draft-far")
MAX_POSITIONS = 256


def _has_xgrammar() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


HAS_XGRAMMAR = _has_xgrammar()


@dataclass(frozen=True)
class World:
    tokenizer: Any  # a HF fast tokenizer, EOS = 0
    target: LlamaForCausalLM
    config: ModelConfig
    drafts: dict[str, tuple[LlamaForCausalLM, ModelConfig]]

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos(self) -> int:
        return self.config.eos_token_ids[0]


def _tokenizer() -> Any:
    """A byte-level BPE tokenizer (a little under 300 ids, EOS = 0) trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT)


def _model_config(vocab_size: int, hidden: int, layers: int) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=MAX_POSITIONS,
        qk_norm=True,
        eos_token_ids=(0,),
    )


def _random_model(config: ModelConfig, seed: int, std: float) -> LlamaForCausalLM:
    """Matrices ~ N(0, std), norms = 1: large enough for sharp, varied greedy continuations."""
    model = LlamaForCausalLM(config, torch.float32, "cpu")  # torch kernels
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def _perturbed(model: LlamaForCausalLM, seed: int, std: float) -> LlamaForCausalLM:
    copy = LlamaForCausalLM(model.config, torch.float32, "cpu")
    copy.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in copy.named_parameters():
            if not name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * std)
    return copy.eval()


@functools.cache
def world() -> World:
    tokenizer = _tokenizer()
    config = _model_config(len(tokenizer), hidden=32, layers=1)
    target = _random_model(config, seed=1, std=0.25)
    far_config = _model_config(len(tokenizer), hidden=32, layers=1)
    drafts = {
        "fuzz:draft-self": (target, config),
        "fuzz:draft-near": (_perturbed(target, seed=2, std=0.05), config),
        "fuzz:draft-far": (_random_model(far_config, seed=3, std=0.25), far_config),
    }
    return World(tokenizer, target, config, drafts)


class _InlineQueue:
    """The queue of an :class:`_InlineStream`: ``put`` runs the item at once."""

    def __init__(self, stream: CpuStream) -> None:
        self._stream = stream

    def put(self, item: Any) -> None:
        with torch.no_grad():  # as the worker threads: device work builds no autograd graph
            self._stream._step(item)


class _InlineStream(CpuStream):
    """A ``CpuStream`` that runs each item as it is enqueued, on the caller's thread. Only its
    queue differs: ``CpuStream.enqueue`` and ``CpuEvent.record`` put onto it as onto a worker's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._error: BaseException | None = None
        self._closed = False
        self._queue = _InlineQueue(self)  # type: ignore[assignment]

    def close(self) -> None:
        pass  # no worker to stop


class InlineCpuDevice(CpuDevice):
    """``CpuDevice`` without worker threads: work runs at enqueue, in order, so every event is
    complete when recorded. The engine's calls come in the same order as with threads (the
    batch queue still schedules N+1 before updating N); only wall-clock overlap is gone, which
    makes a scenario exactly replayable and several times cheaper on a busy machine."""

    def __init__(self) -> None:
        self.torch_device = torch.device("cpu")
        self.index = 0
        self.compute_stream = _InlineStream("compute")
        self.h2d_stream = _InlineStream("h2d")
        self.d2h_stream = _InlineStream("d2h")
        self._streams = (self.compute_stream, self.h2d_stream, self.d2h_stream)


@contextlib.contextmanager
def cached_models(threaded: bool = False) -> Iterator[World]:
    """While open, an ``EngineCore`` gets the world's target and drafts instead of loading any
    (the engine's own model code runs them; only the construction is skipped), and an
    :class:`InlineCpuDevice` unless ``threaded`` (the real worker-thread ``CpuDevice``)."""
    w = world()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads cost more than they give

    def build_device(config: Any) -> CpuDevice:
        return CpuDevice() if threaded else InlineCpuDevice()

    def build_model(*args: Any, **kwargs: Any) -> tuple[Any, ModelConfig]:
        return w.target, w.config

    def load_draft(folder: str, *args: Any, **kwargs: Any) -> tuple[Any, ModelConfig]:
        return w.drafts[folder]

    try:
        with (
            mock.patch("engine.core.build_model", build_model),
            mock.patch("engine.core.build_device", build_device),
            mock.patch("engine.spec.draft.load_model", load_draft),
        ):
            yield w
    finally:
        torch.set_num_threads(threads)
