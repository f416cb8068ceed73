"""The push state machine without engines: matching by transfer id in both orders, pruning, forgetting, deadlines."""

from __future__ import annotations

from kv.push_matching import PushMatcher, ReceiveDeadlines, write_window


def registration(transfer_id: str) -> dict:
    return {"transfer_id": transfer_id, "local_block_ids": [[1, 2]], "request_id": f"decode-{transfer_id}"}


def test_registration_first_waits_for_its_request():
    matcher = PushMatcher(max_wait_s=10)
    assert matcher.registration_arrived(registration("t1"), "t1", now=0.0) is None
    assert matcher.take_registration("prefill-1", now=1.0) is None  # a request not yet known to carry t1
    matcher.request_finished("prefill-1", "t1")
    found, waited = matcher.take_registration("prefill-1", now=2.5)
    assert found == registration("t1") and waited == 2.5
    assert matcher.take_registration("prefill-1", now=3.0) is None  # taken once


def test_prefill_finished_first_is_found_by_the_registration():
    matcher = PushMatcher(max_wait_s=10)
    matcher.request_finished("prefill-1", "t1")
    assert matcher.take_registration("prefill-1", now=0.0) is None
    assert matcher.registration_arrived(registration("t1"), "t1", now=1.0) == "prefill-1"


def test_matching_is_by_transfer_id_only():
    matcher = PushMatcher(max_wait_s=10)
    matcher.request_finished("cmpl-abc-11111111", "t1")
    # same request-id base, other transfer id: no match
    assert matcher.registration_arrived(registration("t2"), "t2", now=0.0) is None
    assert matcher.take_registration("cmpl-abc-11111111", now=0.1) is None
    assert matcher.registration_arrived(registration("t1"), "t1", now=0.2) == "cmpl-abc-11111111"


def test_registration_whose_blocks_are_still_in_flight_is_kept():
    matcher = PushMatcher(max_wait_s=10)
    matcher.request_finished("prefill-1", "t1")
    assert matcher.registration_arrived(registration("t1"), "t1", now=0.0) == "prefill-1"
    matcher.keep_waiting(registration("t1"), "t1", now=0.0)
    assert matcher.take_registration("prefill-1", now=0.5)[0] == registration("t1")


def test_unmatched_registrations_are_pruned_after_max_wait():
    matcher = PushMatcher(max_wait_s=5)
    matcher.registration_arrived(registration("old"), "old", now=0.0)
    matcher.registration_arrived(registration("new"), "new", now=6.0)
    matcher.prune(now=6.0)  # drops "old" only
    matcher.request_finished("prefill-old", "old")
    assert matcher.take_registration("prefill-old", now=6.1) is None
    assert len(matcher) == 2  # one request, one registration ("new")


def test_forget_releases_all_state_of_a_request():
    matcher = PushMatcher(max_wait_s=10)
    matcher.request_finished("prefill-1", "t1")
    matcher.keep_waiting(registration("t1"), "t1", now=0.0)
    matcher.forget("prefill-1")
    assert len(matcher) == 0
    assert matcher.registration_arrived(registration("t1"), "t1", now=1.0) is None  # no longer known


def test_receive_deadlines():
    deadlines = ReceiveDeadlines(timeout_s=2)
    deadlines.arm("done", now=0.0)
    deadlines.arm("late", now=0.0)
    deadlines.arm("fresh", now=1.5)
    waiting = {"late", "fresh"}
    assert deadlines.expired(now=1.0, still_waiting=waiting.__contains__) == []
    assert len(deadlines) == 2  # "done" dropped: it finished in time
    assert deadlines.expired(now=2.5, still_waiting=waiting.__contains__) == ["late"]
    assert deadlines.expired(now=3.6, still_waiting=waiting.__contains__) == ["fresh"]
    assert len(deadlines) == 0


def test_a_registration_past_the_write_window_is_never_written():
    """Prefill finishing late must not WRITE into blocks decode already gave up on."""
    timeout_s = 10
    matcher = PushMatcher(max_wait_s=write_window(timeout_s))
    matcher.registration_arrived(registration("t1"), "t1", now=0.0)
    matcher.request_finished("prefill-1", "t1")
    assert matcher.take_registration("prefill-1", now=write_window(timeout_s) + 0.01) is None
    assert write_window(timeout_s) < timeout_s


def test_a_registration_inside_the_write_window_is_written():
    matcher = PushMatcher(max_wait_s=write_window(10))
    matcher.registration_arrived(registration("t1"), "t1", now=0.0)
    matcher.request_finished("prefill-1", "t1")
    assert matcher.take_registration("prefill-1", now=write_window(10) - 0.01)[0] == registration("t1")


def test_a_withdrawn_registration_is_never_written():
    matcher = PushMatcher(max_wait_s=8)
    matcher.registration_arrived(registration("t1"), "t1", now=0.0)
    assert matcher.withdraw("t1", now=1.0)  # no WRITE was posted: decode may free its blocks
    matcher.request_finished("prefill-1", "t1")  # prefill finishes afterwards
    assert matcher.take_registration("prefill-1", now=1.5) is None
    assert not matcher.claim_write("t1")


def test_a_withdrawal_that_overtakes_its_registration_still_stops_it():
    matcher = PushMatcher(max_wait_s=8)
    assert matcher.withdraw("t1", now=0.0)
    assert matcher.registration_arrived(registration("t1"), "t1", now=0.1) is None
    matcher.request_finished("prefill-1", "t1")
    assert matcher.take_registration("prefill-1", now=0.2) is None


def test_a_withdrawal_after_the_write_was_posted_is_refused():
    """The WRITE is on its way: decode must wait for its completion, not free its blocks now."""
    matcher = PushMatcher(max_wait_s=8)
    matcher.request_finished("prefill-1", "t1")
    assert matcher.claim_write("t1")
    assert not matcher.withdraw("t1", now=0.0)
    matcher.forget("prefill-1")
    assert len(matcher) == 0


def test_withdrawals_are_pruned_after_the_write_window():
    matcher = PushMatcher(max_wait_s=8)
    matcher.withdraw("t1", now=0.0)
    matcher.prune(now=7.0)
    assert len(matcher) == 1
    matcher.prune(now=8.5)
    assert len(matcher) == 0
