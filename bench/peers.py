"""The app against its peers, side by side in one run: same model, dtype, cores; prefix caching off everywhere.

    python -m bench.peers [--config configs/cpu-tiny.yaml] [--lengths 128 512 1024 1900] [--repeats 10]
                          [--concurrency 1 4 16 32] [--out bench/results] [--update-readme]

Systems:
- `vllm`: vLLM's own OpenAI server, one engine doing prefill and decode together (the colocated baseline), bound to
  the prefill side's cores;
- `vllm-x2`: two such servers, one per side's cores, behind a round-robin client (what these cores run instead of
  1P1D);
- `push`, `pull`, `local`: this app, each request in that mode;
- `auto`: this app, each request in the mode its policy chooses (app/policy/mode_policy.py; the decision mix
  is reported);
- `rsllm-pd`: Ray Serve LLM's `build_pd_openai_app` with vLLM's NixlConnector, engines on the same cores;
- `serve-floor`: Ray Serve alone on the app's hops (proxy, ingress replica, handle stream from a second replica),
  streaming a token every `--floor-itl-ms` with no engine (bench/systems.py): the app's cost above Ray Serve's own.

Workloads: one request at a time at each prompt length (TTFT, second-token gap), then a concurrency sweep over a
fixed mix of prompt lengths (TTFT, ITL, TPOT, throughput). At one request at a time the systems take turns request by
request; every system's engines are frozen while another is measured (bench/systems.py says why). The app's KV
transfer counters must show that every request served push or pull moved its prompt's KV.

Writes results.json, results.md and two plots into --out; --update-readme puts results.md into README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from tqdm import tqdm

from bench.load import Sample, Target, percentile, run_concurrent
from bench.report import machine, update_readme
from bench.systems import ROOT, System, bench_config, side_by_side

APP_MODES = ("push", "pull", "local", "auto")
SYSTEMS = ("vllm", "vllm-x2", *APP_MODES, "rsllm-pd", "serve-floor")  # the order of the report's columns
LENGTH_MIX = (128, 512, 1024)  # the concurrency sweep's prompt lengths, drawn uniformly
README_START, README_END = "<!-- bench.peers results: start -->", "<!-- bench.peers results: end -->"


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 4000) for _ in range(n)]


class Bench:
    def __init__(self, systems: dict[str, tuple[System, Target]], output_tokens: int):
        self.systems = systems
        self.output_tokens = output_tokens
        self.served: dict[str, list[int]] = defaultdict(list)  # prompt lengths of the app's requests, by mode served

    async def measure(self, name: str, prompts: list[list[int]], concurrency: int) -> tuple[list[Sample], float]:
        system, target = self.systems[name]
        system.thaw()
        try:
            samples, wall = await run_concurrent(target, prompts, self.output_tokens, concurrency)
        finally:
            system.freeze()
        for prompt, sample in zip(prompts, samples):
            if mode := sample.decision.get("mode"):
                self.served[mode].append(len(prompt))
        return samples, wall

    async def latency_sweep(self, lengths: list[int], repeats: int) -> dict[str, dict[int, list[Sample]]]:
        rng = random.Random(0)
        names = list(self.systems)
        samples: dict[str, dict[int, list[Sample]]] = defaultdict(lambda: defaultdict(list))
        with tqdm(total=len(lengths) * (repeats + 1) * len(names), desc="one request at a time") as bar:
            for n in lengths:
                for repeat in range(repeats + 1):  # the first round warms each system up and is not kept
                    rng.shuffle(names)  # no system always runs right after the same other one
                    for name in names:
                        [sample], _ = await self.measure(name, [random_prompt(rng, n)], 1)
                        if repeat:
                            samples[name][n].append(sample)
                        bar.update()
        return samples

    async def concurrency_sweep(self, levels: list[int]) -> dict[str, dict[int, dict]]:
        rng = random.Random(1)
        results: dict[str, dict[int, dict]] = defaultdict(dict)
        with tqdm(total=len(levels) * len(self.systems), desc="concurrency sweep") as bar:
            for c in levels:
                prompts = [random_prompt(rng, rng.choice(LENGTH_MIX)) for _ in range(max(2 * c, 8))]
                for name in self.systems:
                    samples, wall = await self.measure(name, prompts, c)
                    results[name][c] = concurrency_stats(samples, wall)
                    if name == "auto":
                        results[name][c]["decisions"] = Counter(s.decision.get("mode") for s in samples)
                    bar.update()
        return results


def concurrency_stats(samples: list[Sample], wall_s: float) -> dict:
    ttfts = [s.ttft * 1e3 for s in samples]
    itls = [gap * 1e3 for s in samples for gap in s.itls]
    tpots = [s.tpot * 1e3 for s in samples if s.tpot is not None]
    return {"requests": len(samples), "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "itl_p50": percentile(itls, 50), "itl_p99": percentile(itls, 99), "tpot_p50": percentile(tpots, 50),
            "throughput_tok_s": sum(len(s.token_times) for s in samples) / wall_s}


def latency_stats(samples: dict[str, dict[int, list[Sample]]]) -> dict[str, dict[int, dict]]:
    stats = {}
    for name, by_length in samples.items():
        stats[name] = {}
        for n, ss in by_length.items():
            entry = {"ttft_p50": statistics.median(s.ttft * 1e3 for s in ss),
                     "ttft_p99": percentile([s.ttft * 1e3 for s in ss], 99),
                     "second_token_gap_p50": statistics.median(s.itls[0] * 1e3 for s in ss),
                     "tpot_p50": statistics.median(s.tpot * 1e3 for s in ss)}
            phases = defaultdict(list)
            for s in ss:
                for phase, ms in s.phases_ms.items():
                    phases[phase].append(ms)
            if phases:
                entry["phases_p50_ms"] = {phase: statistics.median(v) for phase, v in phases.items()}
            stats[name][n] = entry
    return stats


# -- report ------------------------------------------------------------------------------------------------------

def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def markdown(results: dict) -> str:
    lat, conc = results["latency"], results["concurrency"]
    names = [n for n in SYSTEMS if n in lat]
    lines = [f"Machine: {results['machine']}. Model `{results['model']}`, {results['dtype']}, prefix caching off, "
             f"{results['output_tokens']} output tokens per request, greedy. Run {results['date']} with:",
             "", "```", results["command"], "```", "",
             f"**TTFT p50 (ms), one request at a time** ({results['repeats']} per cell, systems in turn):", ""]
    peers = [p for p in ("vllm", "rsllm-pd") if p in lat]
    header = ["prompt tokens", *names] + [f"{m} / {p}" for p in peers for m in APP_MODES if m in lat]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for n in results["lengths"]:
        cell = {name: lat[name][str(n)]["ttft_p50"] for name in names}
        row = [str(n), *(f"{cell[name]:.0f}" for name in names)]
        row += [ratio(cell[m], cell[p]) for p in peers for m in APP_MODES if m in lat]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "**Gap between first and second token p50 (ms), one request at a time:**", "",
              "| prompt tokens | " + " | ".join(names) + " | push / vllm TPOT | pull / vllm TPOT |",
              "|" + "---|" * (len(names) + 3)]
    for n in results["lengths"]:
        gap = {name: lat[name][str(n)]["second_token_gap_p50"] for name in names}
        tpot = lat["vllm"][str(n)]["tpot_p50"]
        lines.append(f"| {n} | " + " | ".join(f"{gap[name]:.1f}" for name in names)
                     + f" | {ratio(gap.get('push'), tpot)} | {ratio(gap.get('pull'), tpot)} |")
    phased = [m for m in APP_MODES if m in lat and "phases_p50_ms" in lat[m][str(results["lengths"][0])]]
    if phased:
        lines += ["", "**Where the app's TTFT goes: median ms per phase** (app/flow/timeline.py; TTFT here is the "
                  "ingress's own stamp, without the HTTP proxy):", ""]
        phases = list(lat[phased[0]][str(results["lengths"][0])]["phases_p50_ms"])
        for m in phased[1:]:
            phases += [p for p in lat[m][str(results["lengths"][0])]["phases_p50_ms"] if p not in phases]
        lines += ["| mode | prompt tokens | " + " | ".join(phases) + " |", "|" + "---|" * (len(phases) + 2)]
        for m in phased:
            for n in results["lengths"]:
                got = lat[m][str(n)]["phases_p50_ms"]
                lines.append(f"| {m} | {n} | " + " | ".join(f"{got[p]:.1f}" if p in got else "" for p in phases) + " |")
    lines += ["", f"**Concurrency sweep** (prompt lengths drawn from {list(LENGTH_MIX)}, "
              f"2 x concurrency requests, at least 8): p50 / p99 in ms, throughput in output tokens/s", "",
              "| concurrency | system | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 | tok/s |",
              "|---|---|---|---|---|---|---|---|"]
    for c in results["concurrency_levels"]:
        for name in names:
            s = conc[name][str(c)]
            lines.append(f"| {c} | {name} | {s['ttft_p50']:.0f} | {s['ttft_p99']:.0f} | {s['itl_p50']:.1f} | "
                         f"{s['itl_p99']:.1f} | {s['tpot_p50']:.1f} | {s['throughput_tok_s']:.0f} |")
    lines += ["", "Ratios at each concurrency: 1P1D pull against two plain engines (`vllm-x2`) and against "
              "Ray Serve LLM PD:", "", "| concurrency | ITL p99 pull / vllm-x2 | tok/s pull / vllm-x2 | "
              "TTFT p50 pull / rsllm-pd |", "|---|---|---|---|"]
    for c in results["concurrency_levels"]:
        pull, x2, rs = (conc.get(n, {}).get(str(c)) for n in ("pull", "vllm-x2", "rsllm-pd"))
        lines.append(f"| {c} | {ratio(pull and pull['itl_p99'], x2 and x2['itl_p99'])} | "
                     f"{ratio(pull and pull['throughput_tok_s'], x2 and x2['throughput_tok_s'])} | "
                     f"{ratio(pull and pull['ttft_p50'], rs and rs['ttft_p50'])} |")
    lines += above_serve_floor(results)
    if "auto" in conc:
        fixed = [m for m in APP_MODES[:3] if m in conc]
        lines += ["", "`auto` at each concurrency: its TTFT p50 against the best fixed mode's, and the modes it chose:",
                  "", "| concurrency | auto TTFT p50 | best fixed mode | auto / best | auto / vllm-x2 | decisions |",
                  "|---|---|---|---|---|---|"]
        for c in results["concurrency_levels"]:
            auto, best = conc["auto"][str(c)], min(fixed, key=lambda m: conc[m][str(c)]["ttft_p50"])
            x2 = conc.get("vllm-x2", {}).get(str(c))
            mix = ", ".join(f"{m} {n}" for m, n in sorted(auto["decisions"].items(), key=lambda kv: -kv[1]))
            lines.append(f"| {c} | {auto['ttft_p50']:.0f} | {best} {conc[best][str(c)]['ttft_p50']:.0f} | "
                         f"{ratio(auto['ttft_p50'], conc[best][str(c)]['ttft_p50'])} | "
                         f"{ratio(auto['ttft_p50'], x2 and x2['ttft_p50'])} | {mix} |")
    kv = results["kv_check"]
    lines += ["", f"KV check (the app's engine counters over the whole run): {kv['summary']}", "",
              handoff_weight(results), "",
              "![TTFT vs prompt length](ttft_vs_length.png)", "![TTFT and ITL vs concurrency](concurrency.png)"]
    return "\n".join(lines) + "\n"


def above_serve_floor(results: dict) -> list[str]:
    """What the app adds to TTFT over a plain engine, against what Ray Serve's own hops cost with no engine."""
    lat = results["latency"]
    modes = [m for m in APP_MODES[:3] if m in lat]
    if "serve-floor" not in lat or "vllm" not in lat or not modes:
        return []
    lines = ["", f"**The app above Ray Serve's own floor**, one request at a time: `serve-floor` streams a token every "
             f"{results['floor_itl_ms']:g} ms with no engine over the app's hops, so its TTFT is what Serve alone "
             "costs; each mode's TTFT above plain vLLM's, less that, is the app's own (ms, p50):", "",
             "| prompt tokens | serve-floor TTFT | " + " | ".join(f"{m} - vllm" for m in modes) + " | "
             + " | ".join(f"{m}: app's own" for m in modes) + " |", "|" + "---|" * (2 + 2 * len(modes))]
    for n in results["lengths"]:
        floor, plain = lat["serve-floor"][str(n)]["ttft_p50"], lat["vllm"][str(n)]["ttft_p50"]
        over = [lat[m][str(n)]["ttft_p50"] - plain for m in modes]
        lines.append(f"| {n} | {floor:.1f} | " + " | ".join(f"{o:.0f}" for o in over) + " | "
                     + " | ".join(f"{o - floor:.0f}" for o in over) + " |")
    return lines


def plots(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat, conc = results["latency"], results["concurrency"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, by_length in lat.items():
        ax.plot(results["lengths"], [by_length[str(n)]["ttft_p50"] for n in results["lengths"]], marker="o",
                label=name)
    ax.set(xlabel="prompt tokens", ylabel="TTFT p50 (ms)", title="TTFT, one request at a time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_vs_length.png", dpi=110)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, by_c in conc.items():
        levels = results["concurrency_levels"]
        left.plot(levels, [by_c[str(c)]["ttft_p50"] for c in levels], marker="o", label=name)
        right.plot(levels, [by_c[str(c)]["itl_p99"] for c in levels], marker="o", label=name)
    left.set(xlabel="concurrent requests", ylabel="TTFT p50 (ms)", xscale="log", title="TTFT")
    right.set(xlabel="concurrent requests", ylabel="ITL p99 (ms)", xscale="log", title="inter-token latency p99")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=110)


def kv_check(before: dict, after: dict, requests: dict[str, list[int]]) -> dict:
    """Did every disaggregated request move its prompt's KV? From the engines' own counters. `requests`: the
    prompt lengths of the app's requests, by the mode each was served in."""
    def grew(role: str, key: str, group: str) -> int:
        return after[role][group].get(key, 0) - before[role][group].get(key, 0)

    expected_tokens = sum(sum(requests[m]) for m in ("push", "pull"))
    got = {"push_writes": grew("prefill", "push_transfers", "kv_transfers"),
           "pull_reads": grew("decode", "pull_transfers", "kv_transfers"),
           "decode_tokens_by_transfer": grew("decode", "external_kv_transfer", "prompt_tokens_by_source"),
           "failed_transfers": grew("decode", "failed_transfers", "kv_transfers")
           + grew("prefill", "failed_transfers", "kv_transfers")}
    want = {"push_writes": len(requests["push"]), "pull_reads": len(requests["pull"]),
            "decode_tokens_by_transfer": expected_tokens, "failed_transfers": 0}
    ok = got == want
    summary = (f"{'every' if ok else 'NOT every'} push and pull request moved its KV: "
               + ", ".join(f"{k} {got[k]} (expected {want[k]})" for k in want))
    moved = grew("prefill", "push_bytes", "kv_transfers") + grew("decode", "pull_bytes", "kv_transfers")
    return {"ok": ok, "got": got, "expected": want, "summary": summary,
            "kv_bytes_per_token": moved / max(got["decode_tokens_by_transfer"], 1)}


def handoff_weight(results: dict) -> str:
    """How much the KV hand-off weighs against prefill, from the app's pull timelines: decode's wait for the KV
    (allocation, the READ, the step that notices it) against the prefill's compute."""
    pull = results["latency"].get("pull")
    if not pull or "phases_p50_ms" not in pull[str(results["lengths"][0])]:
        return ""
    shares = []
    for n in results["lengths"]:
        phases = pull[str(n)]["phases_p50_ms"]
        shares.append(f"{phases['kv_wait']:.1f} ms at {n} tokens ({phases['kv_wait'] / phases['prefill_compute']:.0%} "
                      f"of its prefill's {phases['prefill_compute']:.0f} ms)")
    return (f"KV hand-off weight: {results['kv_check']['kv_bytes_per_token'] / 1024:.1f} KiB of KV per prompt token; "
            "pull's decode waits for its KV " + ", ".join(shares) + ".")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 1900])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--no-rsllm", action="store_true", help="leave Ray Serve LLM PD out")
    parser.add_argument("--floor-itl-ms", type=float, default=6.0,
                        help="serve-floor's pace: a token every this many ms (plain vLLM's TPOT here)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--update-readme", action="store_true")
    args = parser.parse_args()
    # Stopped by a signal, still tear down what was started (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped"))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise

    config = bench_config(args.config)
    console = Console()
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    console.print(f"logs of the plain vLLM servers: {log_dir}")
    app_headers = {mode: {"x-kv-transfer-mode": mode, "x-pd-timings": "1"} for mode in APP_MODES}
    with side_by_side(config, app_headers, log_dir, console, rsllm=not args.no_rsllm,
                      floor_itl_s=args.floor_itl_ms / 1e3) as run:
        before = run.totals()
        bench = Bench(run.systems, args.output_tokens)
        samples = asyncio.run(bench.latency_sweep(args.lengths, args.repeats))
        concurrency = asyncio.run(bench.concurrency_sweep(args.concurrency))
        run.app.thaw()
        time.sleep(3)  # the engines' stats loops report the last steps
        kv = kv_check(before, run.totals(), bench.served)

    results = {"machine": machine(), "model": config.model_id, "dtype": config.decode.engine_kwargs.get("dtype"),
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "command": "python -m bench.peers " + " ".join(
                   f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                   for k, v in vars(args).items() if k not in ("out", "update_readme", "no_rsllm")),
               "lengths": args.lengths, "repeats": args.repeats, "concurrency_levels": args.concurrency,
               "output_tokens": args.output_tokens, "floor_itl_ms": args.floor_itl_ms, "kv_check": kv}
    results["latency"] = json.loads(json.dumps(latency_stats(samples)))
    results["concurrency"] = json.loads(json.dumps(concurrency))
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (args.out / "results.md").write_text(text)
    plots(results, args.out)
    if args.update_readme:
        update_readme(text, args.out, README_START, README_END)
    console.print(text)


if __name__ == "__main__":
    main()
