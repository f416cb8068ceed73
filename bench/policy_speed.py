"""How long the mode policy takes to decide, per request, at several cluster shapes.

    python -m bench.policy_speed [--decisions 20000] [--seed 0]

Each decision is one `ModePolicy.decide` on a fresh random snapshot (loads, queues, KV use, a replica down now and
then) and a random prompt, with the cost model learning from a random observation after every tenth decision, as
the ingress would. Prints p50/p99/max in microseconds per shape.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from rich.console import Console
from rich.table import Table

from app.policy.mode_policy import (
    MODES, ClusterSnapshot, ModePolicy, Observation, PolicyConfig, ReplicaLoad, RequestFeatures,
)

SHAPES = ((1, 1), (1, 2), (8, 8), (64, 64))


def random_replica(rng: random.Random, name: str) -> ReplicaLoad:
    return ReplicaLoad(name, healthy=rng.random() > 0.02, running=rng.randrange(64), waiting=rng.randrange(8),
                       queued_prefill_tokens=rng.randrange(20_000), kv_cache_usage=rng.random(),
                       decoding=rng.randrange(64))


def measure(prefill: int, decode: int, decisions: int, rng: random.Random) -> list[float]:
    policy = ModePolicy(PolicyConfig())
    took = []
    for n in range(decisions):
        snapshot = ClusterSnapshot(tuple(random_replica(rng, f"p{i}") for i in range(prefill)),
                                   tuple(random_replica(rng, f"d{i}") for i in range(decode)))
        request = RequestFeatures(prompt_tokens=rng.randrange(16, 2048), max_tokens=rng.randrange(1, 512))
        started = time.perf_counter()
        policy.decide(request, snapshot)
        took.append(time.perf_counter() - started)
        if n % 10 == 0:
            policy.model.observe(Observation(rng.choice(MODES), rng.randrange(16, 2048), rng.randrange(64),
                                             prefill_s=rng.random() * 0.3, ttft_s=rng.random() * 0.5,
                                             handoff_s=rng.random() * 0.02))
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    table = Table(title=f"ModePolicy.decide, {args.decisions} decisions per shape")
    for column in ("prefill x decode", "p50 us", "p99 us", "max us"):
        table.add_column(column, justify="right")
    for prefill, decode in SHAPES:
        took = sorted(measure(prefill, decode, args.decisions, random.Random(args.seed)))
        p99 = took[int(0.99 * (len(took) - 1))]
        table.add_row(f"{prefill} x {decode}", f"{statistics.median(took) * 1e6:.1f}", f"{p99 * 1e6:.1f}",
                      f"{took[-1] * 1e6:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
