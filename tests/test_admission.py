"""The ingress's slots and queue by service class (app/policy/admission.py): pure logic, no engines."""

from __future__ import annotations

from app.config import PDAppConfig
from app.policy.admission import LEFT, RUNNING, SHED, WAITING, ClassAdmission
from app.policy.service_class import default_classes
from test_config import raw_cpu_config


def admission(slots: int, queue_size: int) -> ClassAdmission:
    return ClassAdmission(slots, queue_size, default_classes())  # interactive priority 0, batch 10 with half


def states(tickets) -> list[str]:
    return [t.state for t in tickets]


def test_each_class_runs_at_most_its_share_of_the_slots_and_the_rest_wait():
    queue = admission(slots=4, queue_size=4)
    assert queue.limits == {"interactive": 4, "batch": 2}
    batch = [queue.arrive("batch")[0] for _ in range(3)]
    assert states(batch) == [RUNNING, RUNNING, WAITING]
    interactive = [queue.arrive("interactive")[0] for _ in range(3)]  # batch at its share takes none of these
    assert states(interactive) == [RUNNING, RUNNING, WAITING]
    assert queue.running == 4


def test_a_freed_slot_goes_to_the_most_urgent_class_first_then_to_the_earliest():
    queue = admission(slots=2, queue_size=8)
    first, second = queue.arrive("interactive")[0], queue.arrive("interactive")[0]
    batch = queue.arrive("batch")[0]
    later = [queue.arrive("interactive")[0] for _ in range(2)]
    assert queue.leave(first) == [later[0]]
    assert queue.leave(later[0]) == [later[1]]
    assert queue.leave(second) == [batch] and batch.state == RUNNING


def test_a_freed_slot_skips_a_class_at_its_share():
    queue = admission(slots=2, queue_size=8)
    running_batch = queue.arrive("batch")[0]  # batch's share of two slots: one
    interactive = queue.arrive("interactive")[0]
    waiting_batch, late_interactive = queue.arrive("batch")[0], queue.arrive("interactive")[0]
    assert queue.leave(interactive) == [late_interactive]
    assert waiting_batch.state == WAITING
    assert queue.leave(running_batch) == [waiting_batch]


def test_a_full_queue_sheds_the_least_urgent_waiting_request_for_a_more_urgent_one():
    queue = admission(slots=1, queue_size=2)
    queue.arrive("interactive")
    early, late = queue.arrive("batch")[0], queue.arrive("batch")[0]
    ticket, shed = queue.arrive("interactive")
    assert ticket.state == WAITING and shed == [late] and late.state == SHED  # the latest of the least urgent
    ticket, shed = queue.arrive("interactive")
    assert ticket.state == WAITING and shed == [early]
    # Nothing waiting is less urgent: the newcomer is turned away, batch or interactive.
    assert [queue.arrive(c)[0].state for c in ("batch", "interactive")] == [SHED, SHED]
    assert len(queue.waiting) == 2 and queue.running == 1


def test_a_waiting_request_that_gives_up_leaves_the_queue_and_a_shed_one_changes_nothing():
    queue = admission(slots=1, queue_size=1)
    running = queue.arrive("batch")[0]
    waiting = queue.arrive("interactive")[0]
    shed = queue.arrive("interactive")[0]
    assert queue.leave(shed) == [] and queue.waiting == [waiting]
    assert queue.leave(waiting) == [] and queue.waiting == [] and waiting.state == LEFT
    assert queue.leave(running) == [] and queue.running == 0


def test_a_class_with_a_share_below_one_slot_still_gets_one():
    assert admission(slots=1, queue_size=0).limits["batch"] == 1


def test_the_ingress_slots_follow_the_decode_capacity_unless_configured():
    raw = raw_cpu_config()
    assert PDAppConfig.model_validate(raw).ingress_slots == raw["decode"]["engine_kwargs"]["max_num_seqs"]
    raw["ingress"]["slots"] = 10
    assert PDAppConfig.model_validate(raw).ingress_slots == 10


def test_an_interactive_miss_halves_batchs_share_once_per_cut_and_met_requests_grow_it_back():
    queue = admission(slots=32, queue_size=32)  # batch's share: 16
    before = queue.arrive("interactive")[0]
    late = queue.arrive("interactive")[0]
    queue.judged(late, met=False)
    assert queue.limits == {"interactive": 32, "batch": 8}
    queue.judged(late, met=False)  # told twice: counted once
    queue.judged(before, met=False)  # arrived before that cut, which already answered its wait
    assert queue.limits["batch"] == 8
    for _ in range(3):  # each miss by a request that arrived after the last cut cuts again, down to one
        queue.judged(queue.arrive("interactive")[0], met=False)
    assert queue.limits["batch"] == 1
    queue.judged(queue.arrive("interactive")[0], met=False)
    assert queue.limits == {"interactive": 32, "batch": 1}
    # A miss by the least urgent class cuts nothing.
    queue.judged(queue.arrive("batch")[0], met=False)
    assert queue.limits["batch"] == 1
    # Additive increase: one slot more per as many met requests (of any class) as the share holds.
    grown = []
    for _ in range(1 + 2 + 3):
        queue.judged(queue.arrive("batch")[0], met=True)
        grown.append(queue.limits["batch"])
    assert grown == [2, 2, 3, 3, 3, 4]
    for _ in range(200):
        queue.judged(queue.arrive("interactive")[0], met=True)
    assert queue.limits["batch"] == 16  # never past its share


def test_a_cut_share_holds_back_waiting_batch_until_it_grows_again():
    queue = admission(slots=4, queue_size=4)  # batch's share: 2
    batch = [queue.arrive("batch")[0] for _ in range(3)]
    interactive = queue.arrive("interactive")[0]
    queue.judged(interactive, met=False)
    assert queue.limits["batch"] == 1
    assert queue.leave(batch[0]) == [] and batch[2].state == WAITING  # one batch request still runs: its share
    queue.judged(queue.arrive("interactive")[0], met=True)
    assert queue.leave(interactive) == [batch[2]]


def test_with_no_more_urgent_request_left_a_cut_share_is_whole_again():
    queue = admission(slots=8, queue_size=8)  # batch's share: 4
    interactive = queue.arrive("interactive")[0]
    queue.judged(interactive, met=False)
    assert queue.limits["batch"] == 2
    assert states(queue.arrive("batch")[0] for _ in range(3)) == [RUNNING, RUNNING, WAITING]
    queue.leave(interactive)  # nothing left to protect: the waiting batch request runs, and more after it
    assert queue.limits["batch"] == 4 and queue.arrive("batch")[0].state == RUNNING
