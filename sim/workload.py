"""Open-loop arrivals, the same for the simulator and for bench.goodput against real engines: Poisson or on/off
(bursts), prompt lengths log-uniform, heavy-tailed output lengths, a mix of service classes. Seeded."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PROMPT_TOKENS = (64, 1900)
OUTPUT_SCALE, OUTPUT_SHAPE, OUTPUT_MAX = 16, 1.5, 512  # OUTPUT_SCALE x Pareto(OUTPUT_SHAPE) tokens, at most MAX
ON_S, OFF_S = 2.0, 4.0  # on/off arrivals: bursts at (ON_S + OFF_S) / ON_S times the rate
CLASSES = ("interactive", "batch")


@dataclass(frozen=True)
class Arrival:
    at_s: float  # after the window opens
    prompt_tokens: int
    max_tokens: int
    qos_class: str


def arrivals(rate: float, window_s: float, pattern: str, interactive_share: float, max_model_len: int,
             seed: int, prompt_tokens: tuple[int, int] = PROMPT_TOKENS,
             outputs: tuple[float, float, int] = (OUTPUT_SCALE, OUTPUT_SHAPE, OUTPUT_MAX)) -> list[Arrival]:
    """Requests arriving at `rate` a second on average for `window_s`; output lengths of scale x Pareto(shape)
    tokens, at most max (`outputs`)."""
    output_scale, output_shape, output_max = outputs
    rng = random.Random(seed)
    burst = (ON_S + OFF_S) / ON_S if pattern == "onoff" else 1.0
    low, high = map(math.log, prompt_tokens)
    out, on_time = [], 0.0
    while True:
        on_time += rng.expovariate(rate * burst)
        # on/off: arrivals come only in the first ON_S of each period, at `burst` times the rate
        at = on_time if burst == 1.0 else (on_time // ON_S) * (ON_S + OFF_S) + on_time % ON_S
        if at >= window_s:
            return out
        n = int(math.exp(rng.uniform(low, high)))
        tokens = min(int(output_scale * rng.paretovariate(output_shape)), output_max, max_model_len - n - 1)
        qos = CLASSES[0] if rng.random() < interactive_share else CLASSES[1]
        out.append(Arrival(at, n, tokens, qos))
