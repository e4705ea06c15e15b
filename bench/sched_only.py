"""The scheduler alone: host µs of ``schedule`` and ``update_from_output`` per steady decode step.

No engine, no model, no device thread: an ``AsyncScheduler`` (two steps in flight, as the batch
queue runs it) fed by a stand-in runner that returns one token per request in schedule order.
``--batch`` requests of ``--prompt-len`` tokens each produce ``--out-len`` tokens (``ignore_eos``);
a step counts when all of them decode one token. Prints the medians of the engine thread's CPU
clock (``time.thread_time_ns``). To compare two checkouts, run it under each one's
``PYTHONPATH`` (alternating).

    PYTHONPATH=$PWD python bench/sched_only.py --batch 256
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.async_scheduler import AsyncScheduler
from engine.scheduler.outputs import ModelRunnerOutput, SchedulerOutput


def measure(batch: int, prompt_len: int, out_len: int, block_size: int) -> dict[str, float]:
    """Median µs per steady step of ``schedule`` and ``update_from_output``."""
    max_model_len = prompt_len + out_len + block_size
    scheduler = AsyncScheduler(
        SchedulerConfig(
            max_num_seqs=batch,
            max_num_batched_tokens=max(8192, batch),
            max_model_len=max_model_len,
        ),
        CacheConfig(
            num_kv_blocks=batch * (max_model_len // block_size + 1) + 64, block_size=block_size
        ),
    )
    for i in range(batch):
        prompt = [(7 * i + j) % 3000 + 2 for j in range(prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", prompt, params, 0.0, 1))
    times: dict[str, list[int]] = {"schedule": [], "update": []}
    queue: deque[tuple[SchedulerOutput, bool]] = deque()
    while scheduler.has_unfinished_requests() or queue:
        if scheduler.has_unfinished_requests() and len(queue) < 2:
            start = time.thread_time_ns()
            out = scheduler.schedule()
            took = time.thread_time_ns() - start
            steady = out.num_decode_reqs == batch and out.total_num_scheduled_tokens == batch
            if out.total_num_scheduled_tokens:
                queue.append((out, steady))
                if steady:
                    times["schedule"].append(took)
                if len(queue) < 2 and scheduler.has_unfinished_requests():
                    continue
        out, steady = queue.popleft()
        req_ids = list(out.num_scheduled_tokens)
        tokens = [[(out.step * 31 + k) % 3000 + 5] for k in range(len(req_ids))]
        runner_output = ModelRunnerOutput(out.step, req_ids, tokens, [0] * len(req_ids))
        start = time.thread_time_ns()
        scheduler.update_from_output(out, runner_output)
        if steady:
            times["update"].append(time.thread_time_ns() - start)
    return {k: statistics.median(v) / 1e3 for k, v in times.items() if v}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--out-len", type=int, default=96)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    result = measure(args.batch, args.prompt_len, args.out_len, args.block_size)
    for phase, us in result.items():
        print(f"{phase}: {us:.0f} us per steady step (median, engine-thread CPU)")


if __name__ == "__main__":
    main()
