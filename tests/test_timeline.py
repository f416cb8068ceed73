"""The request timeline: phases from stamped events, and the report a client asks for."""

from app.flow.timeline import PHASES, RequestTimeline


def test_phases_span_their_events_and_skip_what_did_not_happen():
    timeline = RequestTimeline(events={"arrival": 100.0})
    timeline.events.update(first_dispatch=100.002, decode_dispatched=100.002, decode_queued=100.005,
                           decode_scheduled=100.005, decode_first_token=100.105, decode_answer=100.108,
                           first_token_sent=100.109)
    phases = timeline.phases()
    assert set(phases) == {"ingress", "to_decode", "kv_wait", "decode_first_step", "decode_return", "ttft"}
    assert abs(phases["decode_first_step"] - 0.1) < 1e-9 and abs(phases["ttft"] - 0.109) < 1e-9


def test_only_the_first_stamp_of_an_event_counts():
    timeline = RequestTimeline()
    timeline.mark("first_token_sent")
    first = timeline.events["first_token_sent"]
    timeline.mark("first_token_sent")
    timeline.add_engine("decode", {"queued": first + 5})
    timeline.add_engine("decode", {"queued": first + 9})
    assert timeline.events["first_token_sent"] == first and timeline.events["decode_queued"] == first + 5


def test_the_replica_that_took_a_leg_last_is_reported():
    """A leg retried on another replica (its first replica died) was served by the second."""
    timeline = RequestTimeline()
    timeline.taken("decode", "replica-a")
    taken_at = timeline.events["decode_taken"]
    timeline.taken("decode", "replica-b")
    assert timeline.report()["replicas"] == {"decode": "replica-b"} and timeline.events["decode_taken"] == taken_at


def test_report_orders_events_from_arrival_in_milliseconds():
    timeline = RequestTimeline(events={"arrival": 10.0, "prefill_dispatched": 10.001, "first_dispatch": 10.001,
                                       "prefill_queued": 10.003})
    report = timeline.report()
    assert list(report["events_ms"]) == ["arrival", "prefill_dispatched", "first_dispatch", "prefill_queued"]
    assert report["events_ms"]["prefill_queued"] == 3.0
    assert report["phases_ms"] == {"ingress": 1.0, "to_prefill": 2.0}


def test_every_phase_is_named_by_known_events():
    stamped = {"arrival", "first_dispatch", "first_token_sent", "second_token_sent"}
    for role in ("prefill", "decode"):
        stamped |= {f"{role}_{event}" for event in ("dispatched", "queued", "scheduled", "first_token", "answer")}
    assert {event for span in PHASES.values() for event in span} <= stamped
