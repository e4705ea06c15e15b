"""User-facing sampling parameters, named as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.fields import (
    check_bool,
    check_int,
    check_number,
    check_str_list,
    check_token_ids,
)

__all__ = ["SamplingParams", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. ``temperature == 0`` means greedy.

    ``top_k <= 0`` disables top-k; ``seed=None`` draws noise from the engine's own counter, so
    only seeded requests are reproducible across runs.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    # Output text, as vLLM's defaults: special tokens left out of the text (with spaces between
    # them when kept), and the stop string / stop token that ended the request left out too.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        """Every field's type and range as vLLM checks them (engine/fields.py); a
        :class:`~engine.fields.FieldError` names the field. Lists are frozen into tuples."""
        num, integer = check_number, check_int
        setattr_ = object.__setattr__
        setattr_(self, "temperature", num("temperature", self.temperature, lo=0.0))
        setattr_(self, "top_p", num("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True))
        integer("top_k", self.top_k, lo=-1, what="-1 or 0 (off), or >= 1")
        setattr_(self, "min_p", num("min_p", self.min_p, lo=0.0, hi=1.0))
        setattr_(
            self,
            "repetition_penalty",
            num("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True),
        )
        for name in ("presence_penalty", "frequency_penalty"):
            setattr_(self, name, num(name, getattr(self, name), lo=-2.0, hi=2.0))
        integer("max_tokens", self.max_tokens, lo=1)
        integer(
            "min_tokens",
            self.min_tokens,
            lo=0,
            hi=self.max_tokens,
            what=(f"in [0, max_tokens={self.max_tokens}]"),
        )
        if self.seed is not None:
            integer("seed", self.seed, lo=0, hi=2**63 - 1)
        setattr_(self, "stop", check_str_list("stop", self.stop))
        setattr_(self, "stop_token_ids", check_token_ids("stop_token_ids", self.stop_token_ids))
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            check_bool(name, getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                integer(name, value, lo=0, hi=MAX_LOGPROBS)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
