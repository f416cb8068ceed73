"""The simulator's clock and engine model (sim/), against cases computed by hand. Pure logic: no engines."""

from __future__ import annotations

import pytest

from sim.clock import Clock
from sim.engine import EngineModel, EngineSpec, SimRequest, StepCost

# 10 ms a step, 0.1 ms a prompt token, 2 ms a decoding request: round numbers to compute by hand.
COST = StepCost(fixed_s=0.010, prefill_s_per_token=1e-4, decode_s_per_request=0.002)


def engine(**limits) -> tuple[Clock, EngineModel]:
    clock = Clock()
    return clock, EngineModel("e0", EngineSpec(step=COST, **limits), clock)


def test_the_clock_runs_events_in_time_order_and_ties_in_the_order_scheduled():
    clock, seen = Clock(), []
    clock.at(2.0, seen.append, "c")
    clock.at(1.0, seen.append, "a")
    clock.at(1.0, lambda: clock.after(0.5, seen.append, "b2"))
    clock.at(1.0, seen.append, "b")
    clock.run(until=1.7)
    assert seen == ["a", "b", "b2"] and clock.now == 1.7 and clock.pending == 1
    clock.run()
    assert seen == ["a", "b", "b2", "c"] and clock.now == 2.0
    with pytest.raises(ValueError, match="past"):
        clock.at(1.0, seen.append, "late")


def test_a_long_prompt_is_computed_in_chunks_then_decoded_a_token_a_step():
    clock, e = engine(max_num_batched_tokens=512)
    request = SimRequest("r", prompt_tokens=1000, max_tokens=3)
    e.add(request)
    clock.run()
    # 512 tokens (10 + 51.2 ms), 488 tokens (10 + 48.8 ms): the first token at 120 ms; then 12 ms a decode step
    assert request.token_times == pytest.approx([0.120, 0.132, 0.144])
    assert e.steps == 4 and e.free_blocks == e.spec.num_blocks and not e.running


def test_requests_decode_in_one_batch_and_a_new_prompt_shares_their_step():
    clock, e = engine()
    a, b = SimRequest("a", 100, 3), SimRequest("b", 100, 3)
    e.add(a)
    e.add(b)
    clock.run(until=0.001)
    late = SimRequest("c", 300, 1, arrival_s=0.001)
    e.add(late)
    clock.run()
    # step 1: both prompts (10 + 20 ms); step 2: both decode, and c's prompt (10 + 4 + 30 ms)
    assert a.token_times[:2] == pytest.approx([0.030, 0.074]) and b.token_times == a.token_times
    assert late.token_times == pytest.approx([0.074])
    assert a.token_times[2] == pytest.approx(0.074 + 0.014)


def test_the_long_prefill_threshold_bounds_a_chunk_beside_decoding_streams():
    clock, e = engine(long_prefill_token_threshold=256)
    stream = SimRequest("s", 10, 4)
    e.add(stream)
    clock.run(until=0.0)
    e.add(SimRequest("p", 1000, 1))
    clock.run()
    # p computes 256 tokens a step, beside s's decode steps
    assert e.steps == 4 + 1  # s's prefill; then p's four chunks, the last with s's final decode step...
    # ...s's tokens are never more than one chunk's step apart: 10 + 2 + 25.6 ms
    gaps = [b - a for a, b in zip(stream.token_times, stream.token_times[1:])]
    assert max(gaps) == pytest.approx(0.0376)


def test_waiting_requests_are_taken_by_priority_then_arrival_and_the_running_limit_holds():
    clock, e = engine(max_num_seqs=1)
    first = SimRequest("first", 100, 2, priority=10, arrival_s=0.0)
    e.add(first)
    clock.run(until=0.0)
    batch = SimRequest("batch", 100, 1, priority=10, arrival_s=0.001)
    interactive = SimRequest("interactive", 100, 1, priority=0, arrival_s=0.002)
    e.add(batch)
    e.add(interactive)
    clock.run()
    assert first.token_times[-1] < interactive.token_times[0] < batch.token_times[0]


def test_running_out_of_blocks_preempts_the_last_in_priority_order_and_it_is_computed_again():
    # 10 blocks of 16 tokens: two prompts of 64 tokens (4 blocks each) fit; as they grow, one must go
    clock, e = engine(num_blocks=10, block_size=16)
    urgent, lax = SimRequest("urgent", 64, 40, priority=0), SimRequest("lax", 64, 40, priority=5, arrival_s=0.0)
    e.add(urgent)
    e.add(lax)
    clock.run()
    assert lax.preemptions >= 1 and urgent.preemptions == 0
    assert len(urgent.token_times) == len(lax.token_times) == 40
    assert urgent.token_times[-1] < lax.token_times[-1]
    assert e.free_blocks == 10


def test_an_aborted_request_frees_its_blocks_and_yields_no_more_tokens():
    clock, e = engine()
    request = SimRequest("r", 500, 100)
    e.add(request)
    clock.run(until=0.1)
    produced = len(request.token_times)
    e.abort(request)
    clock.run()
    assert len(request.token_times) == produced and e.free_blocks == e.spec.num_blocks and not e.busy
    e.reserve(awaiting := SimRequest("awaiting", 500, 10))  # blocks reserved for KV that never comes
    assert e.free_blocks < e.spec.num_blocks
    e.abort(awaiting)
    assert e.free_blocks == e.spec.num_blocks
    on_its_way = SimRequest("on its way", 100, 2)  # cancelled before it reached the engine
    e.abort(on_its_way)
    e.add(on_its_way)
    clock.run()
    assert not on_its_way.token_times and not e.waiting and e.legs_taken == 2


def test_a_dead_engine_loses_every_request_it_held_and_takes_none_until_restarted():
    clock, e = engine(num_blocks=1000)
    lost = []
    running, waiting, held = (SimRequest(name, 500, n, on_lost=lost.append, hold_kv=name == "held")
                              for name, n in (("running", 100), ("waiting", 100), ("held", 1)))
    e.add(held)
    clock.run(until=0.1)  # computed (60 ms), its KV kept
    e.add(running)
    clock.run(until=0.2)  # prefilled (60 ms), decoding
    e.reserve(SimRequest("reserving", 20_000, 5, on_lost=lost.append))  # more blocks than are free
    e.reserve(awaiting := SimRequest("awaiting", 100, 5, on_lost=lost.append))  # reserved, its KV not here yet
    e.add(waiting)
    produced = len(running.token_times)
    e.fail()
    clock.run()
    assert sorted(r.request_id for r in lost) == ["awaiting", "held", "reserving", "running", "waiting"]
    assert awaiting.blocks == 0
    assert len(running.token_times) == produced  # its step in flight never ends
    late = SimRequest("late", 100, 2, on_lost=lost.append)
    e.add(late)
    assert lost[-1] is late and not e.busy
    e.restart()
    again = SimRequest("again", 100, 2)
    e.add(again)
    clock.run()
    assert len(again.token_times) == 2 and e.free_blocks == e.spec.num_blocks
