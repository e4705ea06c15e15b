"""The offline API: ``LLM(...).generate(prompts, SamplingParams)``, and the workload driver.

The driver feeds requests in at their arrival times (relative to the start of the run), aborts
those with ``abort_after_s``, and steps the engine until every request has finished.
"""

from __future__ import annotations

import dataclasses
import gc
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
from engine.scheduler.step_outputs import StepOutputs
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
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

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
        if self.stop_reason is not None:
            out["stop_reason"] = self.stop_reason
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

    Pass an :class:`EngineConfig`, or its fields as keyword arguments: the flat field names of
    its parts (``model=``, ``dtype=``, ``async_scheduling=``, ..., see
    :meth:`EngineConfig.from_flat`).
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
        self.config = config if config is not None else EngineConfig.from_flat(**engine_kwargs)
        self.tokenizer = self._load_tokenizer()
        checker = _StopStrings(self.tokenizer) if self.tokenizer is not None else None
        # tp: a started ``engine.executor.tp_driver.TPDriver`` (for its options); None with
        # tensor_parallel_size > 1 starts one with the defaults.
        self.engine = EngineCore(
            self.config, tracer, checker, trace_requests, tokenizer=self.tokenizer, tp=tp
        )
        self._next_id = 0
        # What construction built (modules, tokenizer tables, kernels, graphs) lives as long as
        # the engine: frozen out of the cyclic collector's walks, as vLLM does after start-up. A
        # full collection walked ~229k objects in ~0.5 s on the 2-core CPU (two EAGLE engines):
        # a pause inside whichever step triggered it. close() unfreezes (docs/design.md §2.14).
        gc.freeze()

    def _load_tokenizer(self) -> Any:
        """The ``tokenizer`` folder's (an error if it has none) or else the model folder's."""
        from engine.model.loader import load_tokenizer

        source = self.config.source

        if source.tokenizer is not None:
            try:
                return load_tokenizer(source.tokenizer)
            except (OSError, ValueError) as err:
                raise ConfigError(f"tokenizer {source.tokenizer!r}: {err}") from None
        if source.model is None:
            return None
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any(os.path.exists(os.path.join(source.model, n)) for n in names):
            return None  # a checkpoint without tokenizer files: token ids only
        try:
            return load_tokenizer(source.model)
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
        on_finish: Callable[[CompletionOutput], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[CompletionOutput]:
        """Run requests at their arrival times; returns outputs in workload order.

        ``on_finish`` is called once per request as it finishes (in finish order), rejected
        ones included (``finish_reason="error"``). When ``should_stop()`` turns True the run stops
        admitting, aborts every request in flight (their partial outputs finish as ``"abort"``)
        and returns: requests that never arrived are left out of the returned list.
        """
        prompts = self._prepare(workload)
        results = {w.id: CompletionOutput(w.id, len(prompts[w.id])) for w in workload}
        run = _Run(self, workload, prompts, results, progress, on_finish)
        run.loop(should_stop or (lambda: False))
        return [results[w.id] for w in workload if w.id in run.admitted]

    def _prepare(self, workload: Sequence[WorkloadRequest]) -> dict[str, list[int]]:
        """Encode and validate every request before the first step (nothing runs on an error)."""
        prompts: dict[str, list[int]] = {}
        too_long: list[str] = []
        for w in workload:
            if w.id in prompts:
                raise ValueError(f"duplicate request id {w.id!r}")
            ids = w.prompt_token_ids
            prompts[w.id] = list(ids) if ids is not None else self._encode(w.prompt or "")
            self._check(w.id, prompts[w.id], w.params)
            if len(prompts[w.id]) + w.params.max_tokens > self.engine.max_model_len:
                too_long.append(
                    f"{w.id!r} ({len(prompts[w.id])} prompt + {w.params.max_tokens} max_tokens)"
                )
        if too_long:  # as vLLM's server: refuse rather than cut the output short
            shown = ", ".join(too_long[:5]) + (
                f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
            )
            raise ConfigError(
                f"{len(too_long)} request(s) cannot get their max_tokens within "
                f"max_model_len={self.engine.max_model_len}: {shown}; lower max_tokens, or raise "
                "--max-model-len / --num-kv-blocks"
            )
        return prompts

    def mean_request_tokens(self, workload: Sequence[WorkloadRequest]) -> float:
        """The workload's mean prompt + ``max_tokens`` per request (text prompts tokenized), the
        length at which :meth:`EngineCore.kv` states its concurrency for this run."""
        if not workload:
            return 0.0
        total = 0
        for w in workload:
            ids = w.prompt_token_ids
            prompt_len = len(ids) if ids is not None else len(self._encode(w.prompt or ""))
            total += prompt_len + w.params.max_tokens
        return total / len(workload)

    def _finish_text(self, result: CompletionOutput, params: SamplingParams) -> None:
        """Detokenize a finished request as vLLM does: special tokens skipped
        (``skip_special_tokens``), the stop string or stop token left out of the text unless
        ``include_stop_str_in_output`` (the token ids keep it)."""
        if self.tokenizer is None:
            return
        ids = result.output_token_ids
        stop = result.stop_reason
        stopped_by_token = result.finish_reason == "stop" and not isinstance(stop, str)
        if stopped_by_token and ids and not params.include_stop_str_in_output:
            ids = ids[:-1]  # EOS or a stop token id: not part of the text
        text = self.tokenizer.decode(
            ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        if result.finish_reason == "stop" and isinstance(stop, str):
            cut = text.find(stop)
            if cut >= 0:
                text = text[: cut + len(stop)] if params.include_stop_str_in_output else text[:cut]
        result.text = text

    def close(self) -> None:
        self.engine.close()
        gc.unfreeze()  # this engine's cycles (and anything frozen since) are collectable again

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Run:
    """One pass of :meth:`LLM.run_workload`: admission at arrival times, deadlines for
    ``abort_after_s``, steps, and the books of which request has arrived and finished."""

    def __init__(
        self,
        llm: LLM,
        workload: Sequence[WorkloadRequest],
        prompts: dict[str, list[int]],
        results: dict[str, CompletionOutput],
        progress: Callable[[int], None] | None,
        on_finish: Callable[[CompletionOutput], None] | None,
    ) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.params = {w.id: w.params for w in workload}
        self.prompts = prompts
        self.results = results
        self.progress = progress
        self.on_finish = on_finish
        self.pending = deque(sorted(workload, key=lambda w: w.arrival_time_s))
        self.aborts: list[tuple[float, str]] = []
        self.admitted: set[str] = set()
        self.live: set[str] = set()  # admitted and not finished

    def loop(self, should_stop: Callable[[], bool]) -> None:
        start = time.monotonic()
        engine = self.engine
        while self.pending or engine.has_work():
            if should_stop():
                self.abort_all()
                break
            now = time.monotonic() - start
            self.admit(now)
            self.abort_due(now)
            if not engine.has_work():
                if self.pending:  # idle until the next arrival (checking for a stop meanwhile)
                    time.sleep(max(0.0, min(self.pending[0].arrival_time_s - now, 0.05)))
                continue
            self.collect(engine.run_step())
        self.collect(engine.drain())

    def admit(self, now: float) -> None:
        while self.pending and self.pending[0].arrival_time_s <= now:
            w = self.pending.popleft()
            self.admitted.add(w.id)
            self.live.add(w.id)
            request = self.llm._request(w.id, self.prompts[w.id], w.params)
            failed = self.engine.add_request(request, w.structured)
            if failed is not None:  # its grammar did not compile: it ends here, alone
                self.collect([failed])
                continue
            if w.abort_after_s is not None:
                self.aborts.append((w.arrival_time_s + w.abort_after_s, w.id))

    def abort_due(self, now: float) -> None:
        for deadline, req_id in [a for a in self.aborts if a[0] <= now]:
            self.aborts.remove((deadline, req_id))
            out = self.engine.abort_request(req_id)
            if out is not None:
                self.collect([out])

    def abort_all(self) -> None:
        """Stop admitting; every request in flight finishes as ``"abort"`` with what it has."""
        self.pending.clear()
        for req_id in sorted(self.live):
            out = self.engine.abort_request(req_id)
            if out is not None:
                self.collect([out])

    def collect(self, outputs: Sequence[RequestOutput]) -> None:
        live, results = self.live, self.results  # once per request per step: locals
        if isinstance(outputs, StepOutputs):
            # Columns of running one-token outputs: the tokens only (no logprobs, no finish).
            for req_id, token_id in zip(
                outputs.plain_req_ids, outputs.plain_token_ids, strict=True
            ):
                if req_id in live:
                    results[req_id].output_token_ids.append(token_id)
            outputs = outputs.explicit
        for o in outputs:
            if o.req_id not in live:  # finished already: nothing more is its
                continue
            res = results[o.req_id]
            res.output_token_ids += o.new_token_ids
            if o.new_logprobs:
                res.logprobs = (res.logprobs or []) + o.new_logprobs
            if not o.finished:
                continue
            self.live.discard(o.req_id)
            res.finish_reason = o.finish_reason
            res.stop_reason = o.stop_reason
            res.error = o.error
            self.llm._finish_text(res, self.params[o.req_id])
            if self.on_finish is not None:
                self.on_finish(res)
            if self.progress is not None:
                self.progress(1)
