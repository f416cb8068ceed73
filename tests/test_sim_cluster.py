"""The simulated app (sim/cluster.py): each mode's legs timed by hand, nothing lost or left behind, shedding by
class, determinism, and the app's own policy code inside it. Pure logic: no engines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import app.policy.admission
import app.policy.load_view
import app.policy.mode_policy
import sim.cluster
from app.policy.mode_policy import PolicyConfig
from app.policy.service_class import default_classes
from sim.clock import Clock
from sim.cluster import SimApp
from sim.engine import EngineSpec, StepCost
from sim.profile import Handoff, Hops, Profile, load_profile
from sim.workload import Arrival, arrivals

# 10 ms a step, 0.1 ms a prompt token, 2 ms a decoding request; hops of 1, 2 and 3 ms; a hand-off of 10 ms plus
# 1 ms per 1,000 tokens.
ENGINE = EngineSpec(StepCost(fixed_s=0.010, prefill_s_per_token=1e-4, decode_s_per_request=0.002), num_blocks=1000)
PROFILE = Profile(name="round", description="round numbers", prefill=ENGINE, decode=ENGINE,
                  hops=Hops(ingress_s=0.001, to_engine_s=0.002, to_client_s=0.003),
                  handoff=Handoff(fixed_s=0.010, bytes_per_s=1e6, kv_bytes_per_token=1))


def simulate(policy: str, requests: list[Arrival], profile: Profile = PROFILE, prefill: int = 1, decode: int = 1,
             drain_s: float = 60.0, **app) -> SimApp:
    simulated = SimApp(profile, prefill, decode, PolicyConfig(policy=policy), default_classes(), Clock(), **app)
    simulated.run(requests, drain_s)
    return simulated


def one(policy: str, prompt: int = 1000, output: int = 3) -> list[float]:
    [served] = simulate(policy, [Arrival(0.0, prompt, output, "interactive")]).served
    assert served.mode == policy and served.done
    return served.token_times


def test_local_prefills_on_decode_and_decodes_there():
    # decided at 1 ms, at the engine at 3 ms; its prompt's step 10 + 100 ms; each token reaches the client 3 ms later;
    # then a decode step of 10 + 2 ms a token
    assert one("local") == pytest.approx([0.116, 0.128, 0.140])


def test_pull_streams_prefills_token_then_decode_reads_the_kv_and_goes_on():
    # prefill's token at 113 ms, the client's at 116 ms; the decode leg is dispatched when prefill's answer is back
    # (116), at decode at 118, reads for 10 + 1 ms (129), and its first step (12 ms) makes the second token at 141
    assert one("pull") == pytest.approx([0.116, 0.144, 0.156])


def test_push_writes_when_prefill_is_done_and_decode_computes_the_last_prompt_token_again():
    # decode registered at 3 ms; the WRITE from 113 to 124 ms; decode computes the last prompt token (a prefill step
    # of one token: 10.1 ms), whose token prefill already sent, then the second token (12 ms)
    assert one("push") == pytest.approx([0.116, 0.1491, 0.1611])


def test_one_output_token_is_answered_by_prefill_alone():
    for mode in ("push", "pull"):
        simulated = simulate(mode, [Arrival(0.0, 500, 1, "interactive")])
        assert simulated.served[0].token_times == pytest.approx([0.001 + 0.002 + 0.060 + 0.003])
        assert all(r.engine.legs_taken == (r.name == "p0") for r in simulated.by_name.values())


@pytest.mark.parametrize("policy", ["push", "pull", "local", "threshold", "auto"])
def test_every_request_gets_its_tokens_and_no_kv_is_left(policy):
    requests = arrivals(4.0, 30, "onoff", 0.7, 2048, seed=3)
    simulated = simulate(policy, requests, load_profile("cpu-tiny"), prefill=1, decode=2)
    served = simulated.served
    assert all(s.done and len(s.token_times) == s.arrival.max_tokens for s in served if not s.shed)
    assert all(a < b for s in served for a, b in zip(s.token_times, s.token_times[1:]))
    for replica in simulated.by_name.values():
        engine = replica.engine
        assert engine.free_blocks == engine.spec.num_blocks and not (engine.held or engine.running or engine.waiting)
        assert replica.in_flight == 0
    if policy in ("push", "pull", "local"):
        assert {s.mode for s in served if not s.shed} == {policy}
    assert sum(simulated.admission.held.values()) == 0


def test_batch_past_its_share_waits_past_the_queue_is_shed_and_interactive_goes_first():
    burst = [Arrival(0.001 * i, 1500, 200, "batch") for i in range(16)]
    burst += [Arrival(0.05 + 0.001 * i, 100, 4, "interactive") for i in range(8)]
    simulated = simulate("pull", burst, slots=8)  # batch may hold half: 4; 8 may wait
    served = simulated.served
    # 4 batch run, 8 wait, 4 find the queue full; 4 interactive take the free slots, and the 4 that must wait
    # each push the latest waiting batch request out.
    assert [s.shed for s in served] == [False] * 8 + [True] * 8 + [False] * 8
    first_token = {i: s.token_times[0] for i, s in enumerate(served) if not s.shed}
    assert max(first_token[i] for i in range(16, 24)) < min(first_token[i] for i in range(4, 8))
    assert all(s.done for s in served if not s.shed)


def test_interactive_requests_missing_their_ttft_cut_batchs_share_until_met_requests_grow_it_back():
    # One long interactive stream, and eight long interactive prompts at once: one prefill engine answers the last
    # four past their 2 s TTFT.
    requests = [Arrival(0.0, 100, 3000, "interactive")]
    requests += [Arrival(0.001 * (1 + i), 4000, 4, "interactive") for i in range(8)]
    requests += [Arrival(10.0 + 0.001 * i, 100, 200, "batch") for i in range(6)]  # later, the stream still on
    simulated = simulate("pull", requests, slots=10)  # batch's share: 5
    stream, interactive, batch = simulated.served[0], simulated.served[1:9], simulated.served[9:]
    assert [s.ttft_s > 2.0 for s in interactive] == [False] * 4 + [True] * 4
    assert simulated.admission.cuts == 1  # the four arrived before the first miss cut batch's share to 2
    starts, ends = sorted(s.token_times[0] for s in batch), sorted(s.token_times[-1] for s in batch)
    assert starts[1] < 10.1 < ends[0] < starts[2] < stream.token_times[-1]  # two ran; a third waited for one
    assert all(s.done for s in simulated.served)


def test_an_interactive_request_waiting_past_its_ttft_cuts_batchs_share_while_it_still_waits():
    clock = Clock()
    simulated = SimApp(PROFILE, 1, 1, PolicyConfig(policy="local"), default_classes(), clock, slots=4)
    for i in range(4):  # long interactive streams hold the four slots
        simulated.submit(Arrival(0.001 * i, 100, 3000, "interactive"))
    late = simulated.submit(Arrival(0.01, 100, 4, "interactive"))
    clock.run(until=1.9)
    assert late.ticket.state == "waiting" and simulated.admission.cuts == 0
    clock.run(until=2.1)  # its 2 s TTFT has passed, no first token yet
    assert late.ticket.state == "waiting" and simulated.admission.cuts == 1
    assert simulated.admission.limits["batch"] == 1


def test_beyond_every_slot_requests_wait_for_one():
    burst = [Arrival(0.0, 200, 20, "interactive") for _ in range(4)]
    simulated = simulate("local", burst, slots=2)  # and two may wait
    assert all(s.done and not s.shed for s in simulated.served)
    first_tokens = sorted(s.token_times[0] for s in simulated.served)
    assert first_tokens[2] > first_tokens[1] + 0.1  # the third waited for one of the first two to end


def test_a_seed_gives_the_same_run():
    def run() -> list[tuple]:
        requests = arrivals(6.0, 20, "poisson", 0.7, 2048, seed=5)
        simulated = simulate("auto", requests, load_profile("cpu-tiny"), prefill=2, decode=3)
        return [(s.mode, s.reason, s.shed, tuple(s.token_times)) for s in simulated.served]
    assert run() == run()


def test_the_simulator_runs_the_apps_own_policy_load_view_and_admission():
    assert sim.cluster.ModePolicy is app.policy.mode_policy.ModePolicy
    assert sim.cluster.ClassAdmission is app.policy.admission.ClassAdmission
    assert sim.cluster.LegsSent is app.policy.load_view.LegsSent
    assert sim.cluster.load_rank is app.policy.load_view.load_rank
    # and no copy of them under sim/
    theirs = {"ModePolicy", "CostModel", "ClassAdmission", "LegsSent", "LegsExpected", "load_rank", "replica_load"}
    for path in Path(sim.cluster.__file__).parent.glob("*.py"):
        defined = {node.name for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
        assert not defined & theirs, (path.name, defined & theirs)


def test_a_profile_reads_from_yaml_and_names_its_sources():
    profile = load_profile("cpu-tiny")
    assert profile.decode.long_prefill_token_threshold == 256 and profile.sources


def failing(policy: str, requests: list[Arrival], fail: tuple[float, str, int], prefill: int = 1, decode: int = 1
            ) -> SimApp:
    """`simulate`, with the replica `fail` names dying at its moment."""
    simulated = SimApp(PROFILE, prefill, decode, PolicyConfig(policy=policy), default_classes(), Clock())
    at, role, index = fail
    simulated.clock.at(at, simulated.fail, role, index)
    simulated.run(requests, 120.0)
    return simulated


def nothing_left_behind(simulated: SimApp) -> None:
    for replica in simulated.by_name.values():
        engine = replica.engine
        assert engine.free_blocks == engine.spec.num_blocks and not (engine.held or engine.running or engine.waiting)
        assert replica.in_flight == 0 and replica.healthy
    assert sum(simulated.admission.held.values()) == 0


def test_a_pull_request_whose_decode_dies_while_reading_reads_again_on_another():
    # as in the pull case above until decode d0, reading from 118 to 129 ms, dies at 120: the decode leg goes to d1
    # at once (at its engine at 122), which reads until 133 and steps (12 ms) to the second token, 3 ms to the client
    simulated = failing("pull", [Arrival(0.0, 1000, 3, "interactive")], (0.120, "decode", 0), decode=2)
    [served] = simulated.served
    assert served.done and served.attempts == 1
    assert served.token_times == pytest.approx([0.116, 0.148, 0.160])
    assert simulated.by_name["d1"].engine.legs_taken == 1
    nothing_left_behind(simulated)


def test_a_request_whose_prefill_dies_before_its_first_token_starts_again_on_the_replicas_left():
    # p0 computes the prompt from 3 ms; it dies at 50: the request is decided again then, at p1 at 52, its token at
    # 162 (165 at the client); then as the pull case: decode reads from 167 to 178, the next tokens at 193 and 205
    simulated = failing("pull", [Arrival(0.0, 1000, 3, "interactive")], (0.050, "prefill", 0), prefill=2)
    [served] = simulated.served
    assert served.done and served.attempts == 2
    assert served.token_times == pytest.approx([0.165, 0.193, 0.205])
    nothing_left_behind(simulated)


@pytest.mark.parametrize("policy", ["push", "pull", "local"])
def test_a_stream_cut_off_ends_with_an_error_and_the_replica_is_replaced(policy):
    # each mode's first token reaches the client at 116 ms; decode dies at 118, during push's WRITE, pull's READ or
    # local's second step. While no decode replica is left, a request fails at once; once the replacement is up
    # (60 s later) requests are served again.
    simulated = failing(policy, [Arrival(0.0, 1000, 3, "interactive"), Arrival(1.0, 100, 3, "interactive"),
                                 Arrival(61.0, 100, 3, "interactive")], (0.118, "decode", 0))
    cut, refused, later = simulated.served
    assert cut.failed and cut.token_times == pytest.approx([0.116]) and not cut.done
    assert refused.failed and not refused.token_times and refused.attempts == 1
    assert later.done and len(later.token_times) == 3
    nothing_left_behind(simulated)
