"""Regenerate the sample workloads from held-out standard-library files.

Run from the repository root::

    python -m samples.workloads.make_workloads

Prompts are the beginnings of real functions from files the sample models never trained on
(the held-out split of ``samples.corpus``), so acceptance rates measured on them are honest.
The output depends on the interpreter's stdlib version; the committed files came from 3.11.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
from pathlib import Path
from typing import Any

from samples.corpus import CorpusFile, is_val_file, list_stdlib_files, read_texts

__all__ = ["function_prompts", "pycode_requests", "shared_prefix_requests", "main"]

VAL_PERCENT = 3  # the split samples/train_models.py trains with


def function_prompts(files: list[CorpusFile], min_chars: int = 60) -> list[str]:
    """For each top-level or method ``def``: its source up to and including the first body
    line after the docstring (signature, docstring, first statement), at most 12 lines."""
    prompts = []
    for corpus_file in files:
        try:
            tree = ast.parse(corpus_file.text)
        except SyntaxError:
            continue
        lines = corpus_file.text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or len(node.body) < 2:
                continue
            first = node.body[1] if ast.get_docstring(node) else node.body[0]
            end = min(first.lineno, node.lineno + 11)  # 1-based, inclusive
            text = "".join(lines[node.lineno - 1 : end])
            if len(text) >= min_chars and "\t" not in text:
                prompts.append(text)
    return prompts


def pycode_requests(prompts: list[str], num: int, duration_s: float, seed: int) -> list[dict]:
    """``num`` requests: half greedy, half temperature 0.8 with a seed; max_tokens 32..128;
    Poisson arrivals rescaled to span ``duration_s``."""
    rng = random.Random(seed)
    chosen = rng.sample(prompts, num)
    gaps = [rng.expovariate(1.0) for _ in range(num)]
    scale = duration_s / sum(gaps[1:])
    arrival, requests = 0.0, []
    for i, prompt in enumerate(chosen):
        arrival += gaps[i] * scale if i else 0.0
        request: dict[str, Any] = {"id": f"pycode-{i:03d}", "prompt": prompt,
                                   "max_tokens": rng.choice([32, 48, 64, 96, 128])}  # fmt: skip
        if i % 2:
            request.update(temperature=0.8, top_p=0.95, seed=1000 + i)
            if i % 8 == 1:
                request.update(top_k=50)
            if i % 8 == 3:
                request.update(min_p=0.05)
        else:
            request.update(temperature=0.0)
        if i % 16 == 4:
            request.update(stop=["\n\n\n"], logprobs=2)
        if i % 16 == 6:
            request.update(ignore_eos=True)
        request["arrival_time_s"] = round(arrival, 4)
        requests.append(request)
    return requests


def shared_prefix_requests(
    file: CorpusFile, prefix_chars: int, num: int, duration_s: float
) -> list[dict]:
    """``num`` greedy requests: the same first ``prefix_chars`` of ``file`` (cut at a line end),
    then each a different ``def`` line of that file, arriving evenly over ``duration_s``."""
    cut = file.text.rfind("\n", 0, prefix_chars) + 1
    prefix = file.text[:cut]
    defs = [line for line in file.text[cut:].splitlines(keepends=True)
            if line.lstrip().startswith("def ")]  # fmt: skip
    if len(defs) < num:
        raise ValueError(f"{file.rel_path} has {len(defs)} defs after the prefix, need {num}")
    step = len(defs) / num
    picked = [defs[int(i * step)] for i in range(num)]
    return [
        {
            "id": f"shared-{i:02d}",
            "prompt": prefix + line,
            "max_tokens": 64,
            "temperature": 0.0,
            "arrival_time_s": round(i * duration_s / num, 4),
        }  # fmt: skip
        for i, line in enumerate(picked)
    ]


def _write_jsonl(path: Path, requests: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("samples/workloads"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    held_out = [f for f in read_texts(list_stdlib_files(include_tests=False))
                if is_val_file(f.rel_path, VAL_PERCENT)]  # fmt: skip
    prompts = function_prompts(held_out)
    _write_jsonl(args.out / "pycode_prompts.jsonl", pycode_requests(prompts, 64, 2.0, args.seed))
    biggest = max(held_out, key=lambda f: f.text.count("\ndef ") + f.text.count("    def "))
    shared = shared_prefix_requests(biggest, 2400, 16, 1.0)
    _write_jsonl(args.out / "shared_prefix.jsonl", shared)
    print(f"{len(held_out)} held-out files, {len(prompts)} function prompts; "
          f"shared prefix from {biggest.rel_path}")  # fmt: skip


if __name__ == "__main__":
    main()
