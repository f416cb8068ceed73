"""Scenarios (sim/scenario.py, sim/scenarios/) and the simulator's command line (python -m sim run): pure logic, no
engines."""

from __future__ import annotations

import json

import pytest

import sim.__main__ as cli
import sim.sweep
from sim.profile import PROFILES, load_profile
from sim.run import simulate, summary
from sim.scenario import SCENARIOS, load_scenario

NAMES = sorted(path.stem for path in SCENARIOS.glob("*.yaml"))


@pytest.mark.parametrize("name", NAMES)
def test_every_scenario_runs_under_every_policy_and_accounts_for_every_request(name):
    scenario = load_scenario(name).with_requests(60)
    requests = scenario.requests()
    assert 30 < len(requests) < 120
    for policy in ("push", "pull", "local", "threshold", "auto"):
        served = simulate(scenario, policy)
        assert [s.arrival for s in served] == requests
        # each one finished in the drain, was turned away, or ended with an error (a replica died under it)
        assert all(s.done + s.shed + s.failed == 1 for s in served), policy
        assert any(s.failed for s in served) == bool(scenario.failures), policy
        result = summary(served, scenario.window_s)
        assert sum(c["arrived"] for c in result["classes"].values()) == len(requests)
        assert all(c["unfinished"] == 0 and c["met"] <= c["arrived"] - c["shed"] for c in result["classes"].values())


def test_rates_are_per_decode_replica_and_a_run_can_be_sized_by_requests():
    steady = load_scenario("steady")
    one, four = len(steady.requests()), len(steady.at_shape(4, 4).requests())
    assert 3.2 < four / one < 4.8
    assert 9_000 < len(steady.at_shape(64, 64).with_requests(10_000).requests()) < 11_000


def test_a_stream_arrives_in_its_own_stretch_with_its_own_prompts():
    storm = load_scenario("long-prompt-storm")
    requests = storm.requests()
    long = [a for a in requests if a.prompt_tokens >= 1500]
    background = [a for a in requests if a.prompt_tokens < 1500]
    assert background and background[-1].at_s > 40  # the steady stream runs throughout
    in_storm = [a for a in long if 20 <= a.at_s < 30]
    assert len(in_storm) > 0.8 * len(long)  # the background's own long prompts are the rest
    assert [a.at_s for a in requests] == sorted(a.at_s for a in requests)
    # Sized by requests, the run is stretched with its storm: a third as many requests, a third as long.
    shorter = storm.with_requests(len(requests) // 3)
    assert shorter.window_s == pytest.approx(20, rel=0.15)
    long = [a for a in shorter.requests() if a.prompt_tokens >= 1500]
    in_storm = [a for a in long if shorter.streams[1].start_s <= a.at_s < shorter.streams[1].start_s
                + shorter.streams[1].window_s]
    assert shorter.streams[1].start_s == pytest.approx(20 * shorter.window_s / 60) and len(in_storm) > 0.8 * len(long)


def test_a_seed_gives_the_same_run_and_another_seed_another():
    scenario = load_scenario("bursty").with_requests(80)

    def run(s):
        return [(x.mode, x.shed, tuple(x.token_times)) for x in simulate(s, "auto")]

    assert run(scenario) == run(scenario)
    assert scenario.requests() != scenario.model_copy(update={"seed": 1}).requests()


def test_the_command_line_runs_each_policy_and_writes_what_it_printed(tmp_path, capsys):
    out = tmp_path / "results.json"
    results = cli.main(["run", "steady", "--shape", "2x3", "--requests", "50", "--policies", "auto", "local",
                        "--json", str(out)])
    assert list(results["policies"]) == ["auto", "local"]
    assert (results["scenario"]["prefill"], results["scenario"]["decode"]) == (2, 3)
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    printed = capsys.readouterr().out
    assert "steady at 2P x 3D" in printed and "interactive" in printed
    with pytest.raises(SystemExit):
        cli.main(["run", "steady", "--shape", "64by64"])


@pytest.mark.parametrize("name", sorted(path.stem for path in PROFILES.glob("*.yaml")))
def test_every_profile_says_where_its_numbers_come_from_and_runs_a_scenario(name):
    profile = load_profile(name)
    assert {"step", "hops", "handoff", "replica_start_s"} <= set(profile.sources), profile.sources
    if not name.startswith("cpu-"):  # not measured here: every assumption says so
        assert "ASSUMED" in profile.sources["step"] and "ASSUMED" in profile.sources["hops"]
    scenario = load_scenario("steady").model_copy(update={"profile": name}).at_shape(2, 2).with_requests(40)
    served = simulate(scenario, "auto")
    assert all(s.done for s in served)


def test_a_replica_failure_moves_with_the_run_and_hits_a_share_of_the_replicas():
    failure = load_scenario("replica-failure")
    assert [f.replicas(64) for f in failure.failures] == [range(8), range(8)]
    assert [f.replicas(1) for f in failure.failures] == [range(1), range(1)]  # at least one
    shorter = failure.with_window(6)
    assert [f.at_s for f in shorter.failures] == pytest.approx([2.0, 2.0])


def test_the_sweep_compares_auto_with_the_best_fixed_mode_at_each_load(tmp_path):
    results = sim.sweep.main(["--scenarios", "steady", "replica-failure", "--shape", "2x2", "--profile", "cpu-tiny",
                              "--loads", "0.5", "2", "--window-s", "10", "--out", str(tmp_path)])
    assert [r["scenario"] for r in results] == ["steady", "replica-failure"]
    for result in results:
        assert list(result["loads"]) == ["0.5", "2"]
        light, heavy = result["loads"].values()
        assert heavy["offered_rps"] == pytest.approx(4 * light["offered_rps"], rel=0.3)
        for row in result["loads"].values():
            fixed = {m: row["policies"][m]["goodput_rps"] for m in ("push", "pull", "local")}
            assert fixed[row["best_fixed"]] == max(fixed.values())
            assert row["auto_vs_best"] == pytest.approx(row["policies"]["auto"]["goodput_rps"] / max(fixed.values()))
    # four times the load is past what 2P x 2D of cpu-tiny serves: fewer requests meet their SLOs
    assert results[0]["loads"]["2"]["policies"]["local"]["attainment"] < 0.5
    assert results[0]["loads"]["0.5"]["policies"]["pull"]["attainment"] > 0.9
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n| steady |") == 2 and "auto / best" in table
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(json.dumps(results))
