"""Per-class admission at the ingress (app/admission.py): pure logic, no engines."""

from __future__ import annotations

from app.admission import ClassAdmission
from app.config import PDAppConfig
from test_config import raw_cpu_config


def test_each_class_holds_at_most_its_share_of_the_slots_and_gets_them_back():
    admission = ClassAdmission(slots=32, max_share={"interactive": 1.0, "batch": 0.5})
    assert admission.limits == {"interactive": 32, "batch": 16}
    assert all(admission.try_take("batch") for _ in range(16))
    assert not admission.try_take("batch")
    assert all(admission.try_take("interactive") for _ in range(32))  # batch at its share takes none of these
    admission.release("batch")
    assert admission.try_take("batch") and not admission.try_take("batch")


def test_a_class_with_a_share_below_one_slot_still_gets_one():
    assert ClassAdmission(slots=3, max_share={"batch": 0.1}).limits == {"batch": 1}


def test_the_ingress_slots_follow_the_decode_capacity_unless_configured():
    raw = raw_cpu_config()
    assert PDAppConfig.model_validate(raw).ingress_slots == raw["decode"]["engine_kwargs"]["max_num_seqs"]
    raw["ingress"]["deployment_config"] = {"max_ongoing_requests": 10}
    assert PDAppConfig.model_validate(raw).ingress_slots == 10
