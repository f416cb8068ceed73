"""The mode policy (app/policy/mode_policy.py): every reason, the cost model against hand-computed numbers, and what it
learns. Pure logic: no engines."""

from __future__ import annotations

import pytest

from app.policy.mode_policy import (
    CONFIGURED,
    DECODE_UNAVAILABLE,
    EXPLORE,
    LOWEST_COST,
    PREFILL_UNAVAILABLE,
    PUSH_UNSUPPORTED,
    REQUESTED,
    RULE,
    ClusterSnapshot,
    CostPriors,
    ModePolicy,
    Observation,
    PolicyConfig,
    ReplicaLoad,
    RequestFeatures,
    ThresholdRule,
    load_level,
)

# Round numbers, so that costs can be computed by hand: 1 ms per 1,000 prompt tokens on either engine, no hand-off
# cost but its fixed 10 ms, no exploring unless a test asks for it.
PRIORS = CostPriors(prefill_s_per_token=1e-6, local_prefill_s_per_token=1e-6,
                    hop_s={"push": 0.003, "pull": 0.002, "local": 0.001}, handoff_fixed_s=0.01,
                    handoff_s_per_byte=0.0, admit_step_s=0.005, explore_every=10**9)


def policy(**config) -> ModePolicy:
    return ModePolicy(PolicyConfig(**{"priors": PRIORS, **config}))


def cluster(prefill=(ReplicaLoad("p0"),), decode=(ReplicaLoad("d0"),)) -> ClusterSnapshot:
    return ClusterSnapshot(tuple(prefill), tuple(decode))


def request(tokens=1000, **fields) -> RequestFeatures:
    return RequestFeatures(prompt_tokens=tokens, max_tokens=16, **fields)


def test_costs_match_the_model_by_hand():
    busy = cluster(prefill=[ReplicaLoad("p0", queued_prefill_tokens=3000)],
                   decode=[ReplicaLoad("d0", decoding=4, queued_prefill_tokens=1000)])
    costs = policy().costs(request(2000), busy)
    # local: hop 1 ms + (1,000 queued + 2,000) x 1 us; each of decode's 4 streams waits out the 2 ms prefill
    assert costs["local"].ttft_s == pytest.approx(0.004) and costs["local"].stall_s == pytest.approx(0.002)
    # pull: hop 2 ms + (3,000 queued + 2,000) x 1 us; admitting the KV holds decode's streams one 5 ms step, and,
    # seeded, its own second token waits for the hand-off (10 ms): the longest gap is 10 ms
    assert costs["pull"].ttft_s == pytest.approx(0.007) and costs["pull"].stall_s == pytest.approx(0.010)
    assert costs["push"].ttft_s == pytest.approx(0.008) and costs["push"].stall_s == pytest.approx(0.010)
    assert costs["pull"].score == pytest.approx(0.017)
    assert costs["local"].score == pytest.approx(0.004 + 4 * 0.002)  # the stall counts once for each stream it holds
    unseeded = policy().costs(request(2000, seeded=False), busy)["pull"]  # the first token waits for the KV
    one_token = policy().costs(RequestFeatures(prompt_tokens=2000, max_tokens=1), busy)  # prefill answers alone
    assert one_token["pull"].stall_s == 0 and one_token["local"].stall_s == pytest.approx(0.002)
    assert unseeded.ttft_s == pytest.approx(0.007 + 0.010 + 0.005) and unseeded.stall_s == pytest.approx(0.005)


def test_auto_takes_the_lowest_predicted_cost():
    idle = policy().decide(request(100), cluster())
    assert (idle.mode, idle.reason) == ("local", LOWEST_COST)  # no stream to stall, no hand-off to pay
    assert idle.decode_replica == "d0" and set(idle.costs) == {"push", "pull", "local"}
    # A long prompt onto a decode engine with streams decoding: each would wait for all of it
    busy = policy().decide(request(20_000), cluster(decode=[ReplicaLoad("d0", decoding=16)]))
    assert (busy.mode, busy.reason) == ("pull", LOWEST_COST) and busy.decode_replica is None  # bound late
    assert busy.costs["pull"].score < busy.costs["local"].score


def test_push_is_chosen_when_its_path_is_the_cheaper_one():
    priors = CostPriors(**{**PRIORS.__dict__, "hop_s": {"push": 0.001, "pull": 0.004, "local": 0.001}})
    decision = policy(priors=priors).decide(request(20_000), cluster(
        decode=[ReplicaLoad("d0", decoding=8), ReplicaLoad("d1", decoding=2)]))
    assert (decision.mode, decision.reason) == ("push", LOWEST_COST)
    assert decision.decode_replica == "d1"  # bound now, to the replica with the fewest streams


def test_push_is_not_chosen_onto_a_decode_whose_kv_is_nearly_full():
    priors = CostPriors(**{**PRIORS.__dict__, "hop_s": {"push": 0.001, "pull": 0.004, "local": 0.001}})
    full = cluster(decode=[ReplicaLoad("d0", decoding=8, kv_cache_usage=0.95)])
    decision = policy(priors=priors).decide(request(20_000), full)
    assert (decision.mode, decision.ruled_out) == ("pull", ("push",))


def test_push_is_not_chosen_while_prompts_queued_at_prefill_would_keep_its_decode_slot_idle():
    priors = CostPriors(**{**PRIORS.__dict__, "hop_s": {"push": 0.001, "pull": 0.004, "local": 0.001},
                           "push_queue_limit_s": 0.005})  # 5,000 queued tokens at 1 us each
    decode = [ReplicaLoad("d0", decoding=8)]
    short = cluster(prefill=[ReplicaLoad("p0", queued_prefill_tokens=4_000)], decode=decode)
    long = cluster(prefill=[ReplicaLoad("p0", queued_prefill_tokens=6_000)], decode=decode)
    taken = policy(priors=priors).decide(request(20_000), short)
    assert (taken.mode, taken.ruled_out) == ("push", ())
    decision = policy(priors=priors).decide(request(20_000), long)
    assert (decision.mode, decision.ruled_out) == ("pull", ("push",))
    assert decision.costs["push"].score < decision.costs["pull"].score


def test_an_explicit_mode_is_obeyed_in_every_mode():
    for mode in ("push", "pull", "local"):
        decision = policy().decide(request(100, requested_mode=mode), cluster())
        assert (decision.mode, decision.reason) == (mode, REQUESTED)
        assert decision.costs  # predicted all the same, for the timeline


def test_a_fixed_policy_is_configured():
    decision = policy(policy="push").decide(request(100), cluster())
    assert (decision.mode, decision.reason) == ("push", CONFIGURED)
    # a client that names auto gets the policy's choice whatever the configured mode
    assert policy(policy="push").decide(request(100, requested_mode="auto"), cluster()).reason == LOWEST_COST
    with pytest.raises(ValueError, match="not among the modes served"):
        policy(policy="push", modes=("pull", "local"))


def test_a_mode_the_engines_do_not_serve_is_refused():
    with pytest.raises(ValueError, match="not served"):
        policy(modes=("pull", "local")).decide(request(requested_mode="push"), cluster())


def test_auto_only_considers_the_modes_served():
    priors = CostPriors(**{**PRIORS.__dict__, "hop_s": {"push": 0.0, "pull": 0.004, "local": 0.001}})
    decision = policy(priors=priors, modes=("pull", "local")).decide(request(20_000), cluster(
        decode=[ReplicaLoad("d0", decoding=8)]))
    assert decision.mode == "pull" and "push" not in decision.costs


def test_prefill_down_is_served_local_under_auto_and_refused_for_a_named_mode():
    down = cluster(prefill=[ReplicaLoad("p0", healthy=False)], decode=[ReplicaLoad("d0", decoding=3)])
    decision = policy().decide(request(20_000), down)
    assert (decision.mode, decision.reason) == ("local", PREFILL_UNAVAILABLE)
    assert set(decision.costs) == {"local"} and decision.decoding == 3  # nothing to predict for a leg that is down
    for named in (policy().decide(request(requested_mode="pull"), down), policy(policy="push").decide(request(), down)):
        assert (named.mode, named.reason) == (None, PREFILL_UNAVAILABLE)
    assert policy().decide(request(requested_mode="local"), down).reason == REQUESTED
    named_auto = policy(policy="pull").decide(request(requested_mode="auto"), down)
    assert (named_auto.mode, named_auto.reason) == ("local", PREFILL_UNAVAILABLE)


def test_the_threshold_rule_goes_local_for_short_prompts_and_a_backed_up_prefill():
    rule = ThresholdRule(local_below_tokens=1000, prefill_queue_tokens=4000, remote_mode="pull")
    threshold = policy(policy="threshold", rule=rule)
    idle, backed_up = cluster(), cluster(prefill=[ReplicaLoad("p0", queued_prefill_tokens=4000),
                                                  ReplicaLoad("p1", queued_prefill_tokens=5000)])
    assert [threshold.decide(request(n), idle).mode for n in (999, 1000)] == ["local", "pull"]
    assert threshold.decide(request(20_000), backed_up).mode == "local"
    # only the least busy prefill engine counts: one with room takes the prompt
    one_free = cluster(prefill=[ReplicaLoad("p0", queued_prefill_tokens=9000), ReplicaLoad("p1")])
    decision = threshold.decide(request(20_000), one_free)
    assert (decision.mode, decision.reason) == ("pull", RULE) and decision.costs  # costs predicted, for the timeline
    # a client may name the rule whatever policy is configured; a push rule sends what push cannot carry by pull
    push_rule = policy(rule=ThresholdRule(remote_mode="push"))
    assert push_rule.decide(request(2000, requested_mode="threshold"), idle).mode == "push"
    assert push_rule.decide(request(2000, requested_mode="threshold", push_capable=False), idle).mode == "pull"
    # without a prefill replica the rule serves local, as auto does
    down = cluster(prefill=[ReplicaLoad("p0", healthy=False)])
    assert threshold.decide(request(20_000), down).mode == "local"
    with pytest.raises(ValueError, match="remote mode 'push' is not served"):
        policy(rule=ThresholdRule(remote_mode="push"), modes=("pull", "local"))
    with pytest.raises(ValueError, match="push or pull"):
        ThresholdRule(remote_mode="local")


def test_decode_down_is_refused():
    for decode in ([], [ReplicaLoad("d0", healthy=False)]):
        decision = policy().decide(request(), cluster(decode=decode))
        assert (decision.mode, decision.reason) == (None, DECODE_UNAVAILABLE)


def test_push_a_request_cannot_take_goes_pull():
    decision = policy().decide(request(requested_mode="push", push_capable=False), cluster())
    assert (decision.mode, decision.reason) == ("pull", PUSH_UNSUPPORTED)
    assert policy(policy="push").decide(request(push_capable=False), cluster()).reason == PUSH_UNSUPPORTED
    cheap_push = CostPriors(**{**PRIORS.__dict__, "hop_s": {"push": 0.0, "pull": 0.004, "local": 0.001}})
    busy = cluster(decode=[ReplicaLoad("d0", decoding=8)])
    assert policy(priors=cheap_push).decide(request(20_000, push_capable=False), busy).mode == "pull"


def test_a_local_prefill_counts_its_stall_once_for_every_stream_it_holds():
    """A 1,000-token prompt: local answers in 2 ms and holds each stream on its decode replica 1 ms; pull answers in
    3 ms and its own second token waits 10 ms for the hand-off, a stall of one stream. Beside one stream local costs
    3 ms against pull's 13; beside ten, 12; beside twelve, 14: pull."""
    for streams, mode in ((1, "local"), (10, "local"), (12, "pull")):
        decision = policy().decide(request(1000), cluster(decode=[ReplicaLoad("d0", decoding=streams)]))
        assert decision.mode == mode, streams
        assert decision.costs["local"].score == pytest.approx(0.002 + streams * 0.001)


def test_a_decode_engine_that_prefills_in_chunks_holds_its_streams_one_chunk():
    """Where the decode engine computes a long prompt a chunk a step while streams decode, a stream's longest gap is
    one chunk's, whatever the prompt's length: the long prompt that went remote above is served local."""
    busy = cluster(decode=[ReplicaLoad("d0", decoding=16)])
    chunked = policy(decode_chunk_tokens=256).decide(request(20_000), busy)
    assert (chunked.mode, chunked.reason) == ("local", LOWEST_COST)
    assert chunked.costs["local"].stall_s == pytest.approx(256e-6)  # 256 tokens x 1 us
    assert chunked.costs["local"].ttft_s == pytest.approx(0.021)  # the prompt's time is the same
    idle = policy(decode_chunk_tokens=256).costs(request(20_000), cluster())["local"]
    assert idle.stall_s == 0  # no stream to hold


def test_only_healthy_replicas_count():
    decision = policy().decide(request(20_000), cluster(
        decode=[ReplicaLoad("d0", decoding=0, healthy=False), ReplicaLoad("d1", decoding=16)]))
    assert decision.mode == "pull"  # d0 would take local at no stall, but it is down


def test_a_batch_request_weighs_its_own_ttft_less():
    # Local is faster for this request, but its prefill stalls decode's streams; an interactive request pays that
    # stall, a batch request (whose TTFT counts a quarter) goes remote.
    busy = cluster(prefill=[ReplicaLoad("p0", queued_prefill_tokens=30_000)], decode=[ReplicaLoad("d0", decoding=2)])
    assert policy().decide(request(20_000), busy).mode == "local"  # 21 + 20 ms against pull's 52 + 10
    assert policy().decide(request(20_000, qos_class="batch"), busy).mode == "pull"  # 5 + 20 ms against 13 + 10


def test_the_prefill_rate_is_learned_per_load_level():
    learner = policy()
    for _ in range(30):  # under load, the prefill engine runs at a third of its idle speed
        learner.model.observe(Observation("pull", prompt_tokens=1000, decoding=6, prefill_s=0.003))
    assert learner.model.prefill("prefill", load_level(6)).s_per_token == pytest.approx(3e-6)
    assert learner.model.prefill("prefill", load_level(0)).s_per_token == pytest.approx(1e-6)  # idle: the prior
    assert learner.model.prefill("prefill", load_level(40)).s_per_token == pytest.approx(3e-6)  # the nearest below
    busy = cluster(prefill=[ReplicaLoad("p0", queued_prefill_tokens=0)], decode=[ReplicaLoad("d0", decoding=6)])
    assert learner.costs(request(1000), busy)["pull"].ttft_s == pytest.approx(0.002 + 0.003)


def test_a_steps_fixed_cost_is_told_from_the_prompts_and_stalls_no_stream():
    """A local prefill's first step also decodes the running streams: that part is learned as the step's fixed
    cost, which streams pay anyway, so only the prompt's own part counts as their stall."""
    learner = policy()
    for n in range(40):  # a 40 ms step, plus 0.1 ms per prompt token
        tokens = (128, 1024, 1900)[n % 3]
        learner.model.observe(Observation("local", prompt_tokens=tokens, decoding=6, prefill_s=0.04 + tokens * 1e-4))
    fitted = learner.model.prefill("decode", load_level(6))
    assert (fitted.step_s, fitted.s_per_token) == (pytest.approx(0.04), pytest.approx(1e-4))
    busy = cluster(decode=[ReplicaLoad("d0", decoding=6)])
    local = learner.costs(request(128), busy)["local"]
    assert local.ttft_s == pytest.approx(0.001 + 0.04 + 0.0128) and local.stall_s == pytest.approx(0.0128)
    learner.model.observe(Observation("pull", prompt_tokens=500, decoding=0, prefill_s=0.05))
    alike = learner.model.prefill("prefill", 0)  # one length seen: no step to tell apart, the line goes through 0
    assert (alike.step_s, alike.s_per_token) == (0.0, pytest.approx(1e-4))


def test_a_queue_drains_at_the_rate_its_waits_teach_not_at_one_prompts_prefill_rate():
    """An engine that batches prompts computes each in about one step whatever its length (140 ms here), while its
    queue drains a step's budget a step (20 us a token): the queue's wait is learned from what queued requests
    waited behind how many tokens, not from the prompts' own prefill times."""
    learner = policy()
    for n in range(40):
        learner.model.observe(Observation("pull", prompt_tokens=(128, 1024, 1900)[n % 3], decoding=0, prefill_s=0.14,
                                          queue_s=50_000 * 2e-5, queued_tokens=50_000))
    learner.model.observe(Observation("pull", prompt_tokens=500, decoding=0, prefill_s=0.14, queue_s=1.0,
                                      queued_tokens=100))  # behind a few tokens, the wait is the step in progress
    assert learner.model.queue_s_per_token("prefill", 0) == pytest.approx(2e-5)
    assert learner.model.queue_s_per_token("decode", 0) == PRIORS.local_prefill_s_per_token  # none seen: the rate
    backed_up = cluster(prefill=[ReplicaLoad("p0", queued_prefill_tokens=100_000)])
    decision = learner.decide(request(1000), backed_up)
    prefill = learner.model.prefill("prefill", 0)
    assert decision.costs["pull"].ttft_s == pytest.approx(0.002 + 100_000 * 2e-5 + prefill(1000))
    assert (decision.mode, decision.queued_tokens) == ("local", 0)  # 2 s behind prefill's queue: decode does it


def test_hops_and_hand_off_are_learned_from_timelines():
    learner = policy()
    for _ in range(60):
        learner.model.observe(Observation("push", prompt_tokens=1000, decoding=0, prefill_s=0.001, queue_s=0.002,
                                          ttft_s=0.023, handoff_s=0.010 + 1000 * 4096 / 1e9))
    assert learner.model.hop_s["push"] == pytest.approx(0.020, rel=1e-3)
    assert learner.model.handoff_s_per_byte == pytest.approx(1e-9, rel=1e-3)
    assert learner.model.hop_s["pull"] == PRIORS.hop_s["pull"]


def test_auto_explores_an_option_not_seen_at_this_load_and_then_stops():
    explorer = policy(priors=CostPriors(**{**PRIORS.__dict__, "explore_every": 3, "min_samples": 1}))
    snapshot = cluster()
    decisions = [explorer.decide(request(100), snapshot) for _ in range(3)]
    assert [d.reason for d in decisions] == [LOWEST_COST, LOWEST_COST, EXPLORE]
    explored = decisions[-1].mode
    assert explored != "local"  # the cheapest is not the one worth exploring
    for mode in ("push", "pull", "local"):
        explorer.model.observe(Observation(mode, prompt_tokens=100, decoding=0, prefill_s=1e-4))
    assert all(explorer.decide(request(100), snapshot).reason == LOWEST_COST for _ in range(9))


def test_decisions_are_deterministic():
    def run() -> list:
        p = policy(priors=CostPriors(**{**PRIORS.__dict__, "explore_every": 4}))
        snapshots = [cluster(decode=[ReplicaLoad("d0", decoding=n % 7), ReplicaLoad("d1", decoding=n % 3)])
                     for n in range(40)]
        return [p.decide(request(64 * (n + 1)), s) for n, s in enumerate(snapshots)]

    assert run() == run()
