"""An engine's worker memory under varied batch shapes, with oneDNN's primitive cache on and off, side by side.

    python -m bench.engine_rss [--seconds 200] [--shapes random|fixed]

Runs two offline vLLM engines on the built-in model at the same time, one per core: one with oneDNN's default
global primitive cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY` unset, 1024 primitives), one with it off (`0`, as the
app's CPU engines run). Each generates batches of random prompt lengths (or always 512 tokens, `--shapes fixed`)
and prints its worker process's RSS every 15 s. No Ray, no connector: what grows here grows in vLLM's CPU worker.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

import psutil

CORES = ("0", "1")


def drive(seconds: float, shapes: str) -> None:
    """One engine on this process's core, printing `seconds requests worker_rss_mib` every 15 s."""
    from vllm import LLM, SamplingParams

    from app.tiny_model import resolve_model_source

    llm = LLM(model=resolve_model_source("builtin://tiny-qwen3"), dtype="float32", max_model_len=2048,
              max_num_seqs=32, enable_prefix_caching=False)
    vocab = llm.get_tokenizer().vocab_size
    rng, me, start, sent, last = random.Random(0), psutil.Process(), time.monotonic(), 0, -15.0
    while (now := time.monotonic() - start) < seconds:
        lengths = [512] * 8 if shapes == "fixed" else [rng.randrange(4, 1800) for _ in range(rng.randrange(1, 17))]
        llm.generate([{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(n)]} for n in lengths],
                     SamplingParams(max_tokens=32, ignore_eos=True, temperature=0), use_tqdm=False)
        sent += len(lengths)
        if now - last >= 15:
            last = now
            worker = max(me.children(recursive=True), key=lambda p: p.memory_info().rss)
            print(f"{now:.0f} {sent} {worker.memory_info().rss / 2**20:.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=200)
    parser.add_argument("--shapes", choices=("random", "fixed"), default="random")
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)  # one engine, in a child process
    args = parser.parse_args()
    if args.drive:
        drive(args.seconds, args.shapes)
        return
    runs = {}
    for label, core, cache in (("cache on (default)", CORES[0], None), ("cache off (the app)", CORES[1], "0")):
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_CPU_KVCACHE_SPACE": "1"}
        env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
        if cache is not None:
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = cache
        runs[label] = subprocess.Popen(
            ["taskset", "-c", core, sys.executable, "-m", "bench.engine_rss", "--drive", "--seconds",
             str(args.seconds), "--shapes", args.shapes],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    series = {label: [tuple(map(float, line.split())) for line in run.stdout] for label, run in runs.items()}
    for run in runs.values():
        run.wait()
    print(f"worker RSS (MiB) under {args.shapes} shapes; s = seconds since the first batch, n = requests done")
    for label, points in series.items():
        first, last = points[0], points[-1]
        trace = "  ".join(f"{s:.0f}s/{n:.0f}:{mib:.0f}" for s, n, mib in points)
        print(f"{label:22} {first[2]:.0f} -> {last[2]:.0f} MiB ({last[2] / first[2] - 1:+.0%}) | {trace}")


if __name__ == "__main__":
    main()
