"""The open-loop workload (sim/workload.py, shared by bench.goodput and the simulator) and bench.goodput's scoring:
pure logic, no engines."""

from __future__ import annotations

from app.policy.service_class import ServiceClass
from bench.goodput import Outcome, cell_stats, met_slo, prompt_ids, request_records
from bench.load import Sample
from sim.workload import OFF_S, ON_S, OUTPUT_MAX, PROMPT_TOKENS, Arrival, arrivals


def test_arrivals_are_seeded_open_loop_and_within_bounds():
    got = arrivals(4.0, 100.0, "poisson", 0.7, 2048, seed=1)
    assert got == arrivals(4.0, 100.0, "poisson", 0.7, 2048, seed=1)  # every system gets the same requests
    assert got != arrivals(4.0, 100.0, "poisson", 0.7, 2048, seed=2)
    assert 320 < len(got) < 480  # ~4/s for 100 s
    assert all(a.at_s < b.at_s for a, b in zip(got, got[1:])) and got[-1].at_s < 100
    assert all(PROMPT_TOKENS[0] <= a.prompt_tokens <= PROMPT_TOKENS[1] for a in got)
    assert all(1 <= a.max_tokens <= min(OUTPUT_MAX, 2048 - a.prompt_tokens - 1) for a in got)
    assert max(a.max_tokens for a in got) > 100  # heavy-tailed: some long ones
    assert 0.6 < sum(a.qos_class == "interactive" for a in got) / len(got) < 0.8
    short = [a.prompt_tokens for a in got if a.prompt_tokens < 350]
    assert 0.35 < len(short) / len(got) < 0.65  # log-uniform: as many below the geometric mean as above
    prompts = prompt_ids(got, seed=1)
    assert [len(p) for p in prompts] == [a.prompt_tokens for a in got] and prompts == prompt_ids(got, seed=1)


def test_on_off_arrivals_come_in_bursts_at_the_same_mean_rate():
    got = arrivals(3.0, 120.0, "onoff", 0.7, 2048, seed=1)
    assert 280 < len(got) < 440
    assert all(a.at_s % (ON_S + OFF_S) < ON_S for a in got)


def _outcome(qos: str, status: str, ttft: float = 0.0, tpot: float = 0.0, tokens: int = 3) -> Outcome:
    sample = None
    if status == "done":
        sample = Sample(ttft, [ttft + i * tpot for i in range(tokens)])
    return Outcome(Arrival(0.0, 1, tokens, qos), status, sample, retry_after=status == "shed")


def test_goodput_counts_requests_that_met_both_slos():
    classes = {"interactive": ServiceClass(ttft_slo_ms=1000, tpot_slo_ms=50),
               "batch": ServiceClass(ttft_slo_ms=10_000, tpot_slo_ms=500)}
    assert met_slo(_outcome("interactive", "done", 0.9, 0.04), classes["interactive"])
    assert not met_slo(_outcome("interactive", "done", 1.1, 0.04), classes["interactive"])  # TTFT missed
    assert not met_slo(_outcome("interactive", "done", 0.9, 0.06), classes["interactive"])  # TPOT missed
    assert met_slo(_outcome("interactive", "done", 0.9, 9.0, tokens=1), classes["interactive"])  # no second token
    outcomes = [_outcome("interactive", "done", 0.5, 0.01), _outcome("interactive", "done", 2.0, 0.01),
                _outcome("interactive", "unfinished"), _outcome("batch", "shed"), _outcome("batch", "done", 5, 0.1)]
    stats = cell_stats(outcomes, classes, window_s=10.0)
    assert stats["interactive"]["met"] == 1 and stats["interactive"]["goodput_rps"] == 0.1
    assert stats["interactive"]["attainment"] == 1 / 3 and stats["interactive"]["unfinished"] == 1
    assert (stats["batch"]["shed"], stats["batch"]["met"], stats["batch"]["shed_without_retry_after"]) == (1, 1, 0)


def test_each_request_is_recorded_with_the_objective_it_missed():
    classes = {"interactive": ServiceClass(ttft_slo_ms=1000, tpot_slo_ms=50),
               "batch": ServiceClass(ttft_slo_ms=10_000, tpot_slo_ms=500)}
    late, slow = _outcome("interactive", "done", 1.5, 0.01), _outcome("interactive", "done", 0.5, 0.2)
    records = request_records(14.0, "auto", [late, slow, _outcome("batch", "shed")], classes)
    assert [(r["met_ttft"], r["met"]) for r in records[:2]] == [(False, False), (True, False)]
    assert records[1]["tpot_ms"] == 200.0 and records[2] == {
        "rate": 14.0, "system": "auto", "class": "batch", "prompt_tokens": 1, "max_tokens": 3, "status": "shed"}
