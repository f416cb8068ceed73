"""Service classes: what a class of requests is promised (TTFT and TPOT objectives), its place in the engines'
queues and its share of the ingress's slots. Its own module, light to import, so the simulator reads the same
definition the app's config does."""

from __future__ import annotations

from pydantic import Field

from kv.config import StrictModel


class ServiceClass(StrictModel):
    """A class of requests with its own latency objectives (goodput counts a request that meets both) and its place
    in the engines' queues."""

    priority: int = Field(
        default=0, ge=-1000, le=1000, description="Passed to vLLM's priority scheduling on every leg: the engines run "
        "waiting requests of a lower number first, and preempt the highest number first when KV blocks run out.")
    ttft_slo_ms: float = Field(gt=0, description="Time to first token the class is promised, client-seen.")
    tpot_slo_ms: float = Field(gt=0, description="Mean time per output token after the first, client-seen.")
    max_share: float = Field(
        default=1.0, gt=0, le=1, description="The share of an ingress replica's request slots (as many as the "
        "decode engines run at once) that requests of this class may hold; past it, a new one waits in the "
        "ingress's queue, behind more urgent classes. Below 1 for batch work, so that it never fills the slots "
        "interactive requests need.")
    ttft_weight: float = Field(
        default=1.0, ge=0, description="How much the `auto` mode policy weighs this class's own TTFT against the "
        "stall a mode imposes on running streams (`mode_policy.stall_weight`): below 1, the class takes a mode "
        "that is cheaper for the others and slower for itself (app/policy/mode_policy.py).")

    def met(self, ttft_s: float, tpot_s: float | None = None) -> bool:
        """Whether a request met this class's objectives: its time to first token and, if it had more than one
        token, its mean time per token after the first."""
        return ttft_s * 1e3 <= self.ttft_slo_ms and (tpot_s is None or tpot_s * 1e3 <= self.tpot_slo_ms)


def default_classes() -> dict[str, ServiceClass]:
    # On this project's CPU presets: a 1,900-token prompt prefills in ~0.4 s idle, a stream steps every 10-30 ms.
    return {"interactive": ServiceClass(priority=0, ttft_slo_ms=2000, tpot_slo_ms=100),
            "batch": ServiceClass(priority=10, ttft_slo_ms=30000, tpot_slo_ms=500, max_share=0.5, ttft_weight=0.25)}
