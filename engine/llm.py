"""The offline API: ``LLM(...).generate(prompts, SamplingParams)``, and the workload driver.

The driver feeds requests in at their arrival times (relative to the start of the run), aborts
those with ``abort_after_s``, and steps the engine until every request has finished.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import ConfigError, EngineConfig
from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.request_output import RequestOutput
from engine.workload import WorkloadRequest
from instrument.tracer import Tracer

__all__ = ["LLM", "CompletionOutput", "outputs_digest"]


@dataclass
class CompletionOutput:
    """One finished request, as ``--output`` writes it."""

    id: str
    num_prompt_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None  # why the request failed (finish_reason "error")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "num_prompt_tokens": self.num_prompt_tokens,
            "output_token_ids": self.output_token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
        }
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.error is not None:
            out["error"] = self.error
        return out


def outputs_digest(outputs: Sequence[CompletionOutput]) -> str:
    """A digest of every request's output tokens, for A/B comparison of two runs."""
    h = hashlib.sha256()
    for out in sorted(outputs, key=lambda o: o.id):
        h.update(out.id.encode())
        h.update(b":" + ",".join(map(str, out.output_token_ids)).encode() + b";")
    return h.hexdigest()[:16]


class _StopStrings:
    """Finds stop strings in the tail of a request's decoded output."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, request: Request) -> str | None:
        stops = request.sampling_params.stop
        if not stops:
            return None
        window = max(len(s) for s in stops) + 8
        tail = self.tokenizer.decode(request.output_token_ids[-window:])
        return next((s for s in stops if s in tail), None)


class LLM:
    """Offline generation on an :class:`EngineCore`.

    Pass an :class:`EngineConfig`, or its fields as keyword arguments. Keyword arguments are :class:`EngineConfig` fields (``model=``, ``dtype=``,
    ``async_scheduling=``, ...).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        tracer: Tracer | None = None,
        trace_requests: bool = False,
        tp: Any = None,
        **engine_kwargs: Any,
    ) -> None:
        if config is not None and engine_kwargs:
            raise ValueError("give an EngineConfig or its fields as keywords, not both")
        self.config = config if config is not None else EngineConfig(**engine_kwargs)
        self.tokenizer = self._load_tokenizer()
        checker = _StopStrings(self.tokenizer) if self.tokenizer is not None else None
        # tp: a started ``engine.distributed.executor.TPDriver`` (for its options); None with
        # tensor_parallel_size > 1 starts one with the defaults.
        self.engine = EngineCore(
            self.config, tracer, checker, trace_requests, tokenizer=self.tokenizer, tp=tp
        )
        self._next_id = 0

    def _load_tokenizer(self) -> Any:
        """The ``tokenizer`` folder's (an error if it has none) or else the model folder's."""
        from engine.model.loader import load_tokenizer

        if self.config.tokenizer is not None:
            try:
                return load_tokenizer(self.config.tokenizer)
            except (OSError, ValueError) as err:
                raise ConfigError(f"tokenizer {self.config.tokenizer!r}: {err}") from None
        if self.config.model is None:
            return None
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any(os.path.exists(os.path.join(self.config.model, n)) for n in names):
            return None  # a checkpoint without tokenizer files: token ids only
        try:
            return load_tokenizer(self.config.model)
        except (OSError, ValueError):
            return None  # a checkpoint without tokenizer files: token ids only

    # ---- building requests ----------------------------------------------------------------
    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("a text prompt needs a tokenizer; this model has none")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def _check(self, req_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise ConfigError(f"request {req_id!r}: stop strings need a tokenizer")
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(
                f"request {req_id!r}: token id {bad[0]} outside the vocab [0, {vocab})"
            )
        limit = self.engine.max_model_len
        if len(prompt_ids) >= limit:
            raise ConfigError(
                f"request {req_id!r}: prompt of {len(prompt_ids)} tokens leaves no room for output "
                f"within max_model_len={limit}"
            )

    def _request(self, req_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        """A fresh Request, made when it arrives (its arrival time is now)."""
        eos = self.engine.eos_token_ids
        if len(eos) > 1:  # extra EOS ids behave as stop tokens (unless ignore_eos)
            extra = () if params.ignore_eos else tuple(eos[1:])
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        return Request(req_id, prompt_ids, params, time.monotonic(), eos[0] if eos else None)

    # ---- running --------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: Callable[[int], None] | None = None,
        structured: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (all arrive at once); outputs in prompt order.

        ``structured``: per prompt, None or ``{"json_schema": {...}}`` / ``{"regex": "..."}`` /
        ``{"choice": [...]}`` (the output is constrained to it)."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("one SamplingParams per prompt, or a single one for all")
        specs = list(structured) if structured is not None else [None] * len(prompts)
        if len(specs) != len(prompts):
            raise ValueError("one structured spec (or None) per prompt")
        workload = []
        for prompt, params, spec in zip(prompts, params_list, specs, strict=True):
            req_id = str(self._next_id)
            self._next_id += 1
            ids = tuple(self._encode(prompt))
            workload.append(WorkloadRequest(req_id, None, ids, params, structured=spec))
        return self.run_workload(workload, progress=progress)

    def run_workload(
        self,
        workload: Sequence[WorkloadRequest],
        progress: Callable[[int], None] | None = None,
    ) -> list[CompletionOutput]:
        """Run requests at their arrival times; returns outputs in workload order."""
        results: dict[str, CompletionOutput] = {}
        prompts: dict[str, list[int]] = {}
        for w in workload:  # encode and validate everything before the first step
            if w.id in prompts:
                raise ValueError(f"duplicate request id {w.id!r}")
            ids = w.prompt_token_ids
            prompts[w.id] = list(ids) if ids is not None else self._encode(w.prompt or "")
            self._check(w.id, prompts[w.id], w.params)
            results[w.id] = CompletionOutput(w.id, len(prompts[w.id]))
        pending = deque(sorted(workload, key=lambda w: w.arrival_time_s))
        aborts: list[tuple[float, str]] = []
        start = time.monotonic()
        engine = self.engine
        while pending or engine.has_work():
            now = time.monotonic() - start
            while pending and pending[0].arrival_time_s <= now:
                w = pending.popleft()
                failed = engine.add_request(
                    self._request(w.id, prompts[w.id], w.params), w.structured
                )
                if failed is not None:  # its grammar did not compile: it ends here, alone
                    self._collect([failed], results, progress)
                    continue
                if w.abort_after_s is not None:
                    aborts.append((w.arrival_time_s + w.abort_after_s, w.id))
            for deadline, req_id in [a for a in aborts if a[0] <= now]:
                aborts.remove((deadline, req_id))
                out = engine.abort_request(req_id)
                if out is not None:
                    self._collect([out], results, progress)
            if not engine.has_work():
                time.sleep(max(0.0, min(pending[0].arrival_time_s - now, 0.05)))
                continue
            self._collect(engine.run_step(), results, progress)
        self._collect(engine.drain(), results, progress)
        if self.tokenizer is not None:
            for result in results.values():
                result.text = self.tokenizer.decode(result.output_token_ids)
        return [results[w.id] for w in workload]

    @staticmethod
    def _collect(
        outputs: list[RequestOutput],
        results: dict[str, CompletionOutput],
        progress: Callable[[int], None] | None,
    ) -> None:
        for o in outputs:
            res = results[o.req_id]
            res.output_token_ids.extend(o.new_token_ids)
            if o.new_logprobs:
                res.logprobs = (res.logprobs or []) + o.new_logprobs
            if o.finished:
                res.finish_reason = o.finish_reason
                res.error = o.error
                if progress is not None:
                    progress(1)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
