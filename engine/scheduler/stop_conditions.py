"""When a request stops, checked after every committed token."""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.scheduler.request_output import StopStringChecker

__all__ = ["check_stop"]


def check_stop(
    request: Request, max_model_len: int, stop_string_checker: StopStringChecker | None = None
) -> bool:
    """Set the request's finished status if its newest output token ends it; return True if so.

    EOS (unless ``ignore_eos``), ``stop_token_ids`` and stop strings are suppressed until
    ``min_tokens`` outputs exist; the length cap (``max_tokens`` or ``max_model_len``) always
    applies. Stop strings need text, so they are delegated to ``stop_string_checker``.
    """
    params = request.sampling_params
    output_token_ids = request.output_token_ids
    last_token_id = output_token_ids[-1]
    num_output_tokens = len(output_token_ids)
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
        if params.stop and stop_string_checker is not None:
            matched = stop_string_checker(request)
            if matched is not None:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = matched
                return True
    num_tokens = request.num_prompt_tokens + num_output_tokens
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
