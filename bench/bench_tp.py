"""Does tensor parallelism pay on 2 GPUs, and which rank holds the steps back?

Qwen3-8B-shaped model with seeded random weights (bf16), a decode-heavy batch, greedy:
TP=1 on one GPU vs TP=2 on two (NCCL). Prints output tok/s per setting and, for TP=2, the merged
rank analysis (per-rank overlap and bubbles, straggler share, collective/arrival wait), and writes
everything as JSON. GPU-only (``nvidia-h200-x2``)::

    python bench/bench_tp.py --batch 64 --output-len 128 --out bench/results/h200/tp.json

NVLink multicast (NVLS) stays off: this script sets ``NCCL_NVLS_ENABLE=0`` before any NCCL
communicator exists (the spawned ranks inherit it); the lent machines require it.

Weights: each TP=2 rank draws every full tensor with the TP=1 seed and keeps its shard, so both
runs serve the same model (greedy digests should agree, up to bf16 all-reduce rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before torch.distributed creates any NCCL communicator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis import analyze_trace  # noqa: E402
from analysis.ranks.report import analyze_ranks  # noqa: E402
from bench._engine_run import decode_workload  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm import LLM, outputs_digest  # noqa: E402
from instrument.schema import rank_trace_path  # noqa: E402
from instrument.tracer import Tracer  # noqa: E402

QWEN3_8B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 151645,
}


def run(tp: int, args: argparse.Namespace, model_config: str, trace_dir: str) -> dict:
    """One engine run; returns throughput and the (merged) analysis headline."""
    config = EngineConfig.from_flat(
        model_config=model_config, random_weights=True, seed=0, dtype="bfloat16",
        device="cuda", tensor_parallel_size=tp, max_num_seqs=max(args.batch, 8),
        max_num_batched_tokens=max(4096, args.batch), num_kv_blocks=args.num_kv_blocks,
        async_scheduling={"on": True, "off": False}[args.async_mode],
        cuda_graphs={"auto": None, "on": True, "off": False}[args.cuda_graphs],
    )  # fmt: skip
    path = os.path.join(trace_dir, f"tp{tp}.pftrace")
    path = rank_trace_path(path, 0) if tp > 1 else path
    tracer = Tracer(path)
    workload = decode_workload(args.batch, args.prompt_len, args.output_len, QWEN3_8B["vocab_size"])
    with LLM(config, tracer=tracer) as llm:
        llm.run_workload(decode_workload(min(args.batch, 8), 16, 4, 1000, prefix="w"))  # warm-up
        start = time.monotonic()
        outputs = llm.run_workload(workload)
        elapsed = time.monotonic() - start
    tracer.close()
    num_tokens = sum(len(o.output_token_ids) for o in outputs)
    result = {
        "tp": tp,
        "batch": args.batch,
        "elapsed_s": elapsed,
        "output_tok_s": num_tokens / elapsed,
        "digest": outputs_digest(outputs),
        "trace": path,
    }
    if tp == 1:
        report = analyze_trace(path)
        result["overlap"] = report.headline["overlap"]
        result["bubble_ratio"] = report.headline["bubble_ratio"]
    else:
        merged = analyze_ranks([rank_trace_path(path, r) for r in range(tp)])
        result["ranks"] = merged.to_dict()["tables"]["ranks"]
        result["straggler_share"] = merged.headline["straggler_share"]
        result["end_spread_us"] = merged.headline["end_spread_us"]
        result["verdicts"] = merged.verdicts
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--async", dest="async_mode", choices=("on", "off"), default="on")
    p.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--out", default=None, help="write the results here as JSON")
    args = p.parse_args()
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="stepscope-tp-")
    model_config = os.path.join(trace_dir, "qwen3_8b.json")
    Path(model_config).write_text(json.dumps(QWEN3_8B))
    results = [run(int(tp), args, model_config, trace_dir) for tp in args.tp.split(",")]
    print(f"{'tp':>3} {'batch':>6} {'tok/s':>10} {'digest':>18}")
    for r in results:
        print(f"{r['tp']:>3} {r['batch']:>6} {r['output_tok_s']:>10.1f} {r['digest']:>18}")
        for line in r.get("verdicts", []):
            print(f"    * {line}")
    if len(results) > 1:
        print(f"TP speedup: {results[-1]['output_tok_s'] / results[0]['output_tok_s']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
