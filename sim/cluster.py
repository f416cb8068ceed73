"""The app, simulated: prefill and decode engine replicas (sim/engine.py) behind the ingress, whose admission, load
view and mode policy are the app's own code (app/policy/admission.py, app/policy/load_view.py,
app/policy/mode_policy.py), and each mode's legs and KV hand-off as the app runs them (app/flow/request_flow.py):
- local: the decode replica the policy bound computes the prompt;
- pull: a prefill replica computes it and samples the first token (sent to the client at once); then a decode
  replica, routed by its load at that moment, reserves blocks and READs the KV; prefill frees its blocks after;
- push: the decode replica the policy bound reserves blocks on arrival and registers them; prefill WRITEs the KV
  the moment it has sampled the first token (and the registration is in); decode computes the last prompt token
  again, as the app's push leg does, and goes on from the second token.
A request with one output token is answered by prefill alone. Engines report their load every `report_period_s`,
stamped with when it last changed, and the ingress adds the legs it sent since, as the app's routers do.

A replica can die (`fail`): the router stops sending it legs, and a replacement takes over after the profile's
`replica_start_s`. A request that lost a leg is met as the app's request flow meets it: started again in the same mode
on the replicas left (up to MAX_ATTEMPTS in all) if nothing had reached its client; a pull request whose decode leg
was lost before it streamed reads its KV again from prefill on another decode replica (up to MAX_ATTEMPTS reads);
otherwise it ends with an error (`failed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from app.flow.request_flow import MAX_ATTEMPTS
from app.flow.timeline import RequestTimeline
from app.policy.admission import RUNNING, SHED, WAITING, ClassAdmission, Ticket
from app.policy.load_view import LegsExpected, LegsSent, load_rank, replica_load
from app.policy.mode_policy import (
    ClusterSnapshot, Decision, ModePolicy, Observation, PolicyConfig, ReplicaLoad, RequestFeatures,
)
from app.policy.service_class import ServiceClass
from sim.clock import Clock
from sim.engine import EngineModel, SimRequest
from sim.profile import Profile
from sim.workload import Arrival


@dataclass
class Served:
    """One request as the client saw it."""

    arrival: Arrival
    timeline: RequestTimeline
    mode: str | None = None
    reason: str = ""
    ticket: Ticket | None = None  # its place at the ingress (app/policy/admission.py)
    token_times: list[float] = field(default_factory=list)  # client-seen, on the virtual clock
    done: bool = False
    failed: bool = False  # ended with an error: no replica to take it, or one died once it had streamed
    attempts: int = 0  # its flow's starts (more than one: a leg's replica died before the client got anything)
    reads: int = 0  # pull: decode legs sent to READ its KV (more than one: a decode replica died before it READ)
    # "prefill", "decode": the legs in flight; "held": prefill's KV kept for decode to READ
    legs: dict[str, tuple[Replica, SimRequest]] = field(default_factory=dict, repr=False)

    @property
    def shed(self) -> bool:
        """Turned away by the ingress's queue (a 429 with Retry-After)."""
        return self.ticket is not None and self.ticket.state == SHED

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival.at_s if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


class Replica:
    def __init__(self, name: str, engine: EngineModel):
        self.name, self.engine = name, engine
        self.last_load: dict = {}
        self.report: dict = {"at": 0.0}
        self.in_flight = 0  # legs the ingress has on it (Serve's own count, which breaks ties between equal ranks)
        self.healthy = True  # False from its death until its replacement is up
        self.seen: dict | None = None  # the report plus legs sent since, as last computed
        self.seen_until = 0.0  # when that stops holding by itself (a leg it counts ages out)
        self.rank: tuple[int, int] = (0, 0)  # its load rank (app/policy/load_view.py), as last computed
        self.load: ReplicaLoad | None = None  # the same, as the policy reads it


class SimApp:
    def __init__(self, profile: Profile, prefill_replicas: int, decode_replicas: int, policy: PolicyConfig,
                 classes: Mapping[str, ServiceClass], clock: Clock, slots: int | None = None):
        self.profile, self.clock, self.classes = profile, clock, classes
        self.replicas = {
            "prefill": [Replica(f"p{i}", EngineModel(f"p{i}", profile.prefill, clock)) for i in range(prefill_replicas)],
            "decode": [Replica(f"d{i}", EngineModel(f"d{i}", profile.decode, clock)) for i in range(decode_replicas)]}
        self.by_name = {r.name: r for role in self.replicas.values() for r in role}
        self.sent = {role: LegsSent() for role in self.replicas}
        self.expected = {role: LegsExpected() for role in self.replicas}
        # The decode engines' chunk, as the app reads it from its engines' configuration
        self.policy = ModePolicy(replace(policy, decode_chunk_tokens=profile.decode.chunk_tokens))
        # As many as the decode engines run at once (app/config.py ingress_slots), in one ingress, and as many
        # waiting in its queue
        self.slots = slots or decode_replicas * profile.decode.max_num_seqs
        self.admission = ClassAdmission(self.slots, self.slots, classes)
        self.waiting: dict[Ticket, Served] = {}
        self.served: list[Served] = []
        self._report()

    # -- load reports and the ingress's view of them ------------------------------------------------------------

    def _report(self) -> None:
        now = self.clock.now
        for replica in self.by_name.values():
            load = replica.engine.report()
            if load != replica.last_load:
                replica.last_load = load
                replica.report = {**load, "at": now}
                replica.seen = None
        self.clock.after(self.profile.report_period_s, self._report)

    def _seen(self, role: str, replica: Replica) -> dict:
        """The replica's load as the ingress's router sees it (app/policy/load_view.py). Kept between calls while
        nothing it depends on changed: its report, the legs sent to it, and which of those still count by their
        age."""
        if replica.seen is None or self.clock.now >= replica.seen_until:
            sent = self.sent[role]
            replica.seen = sent.load(replica.name, replica.report, self.clock.now)
            replica.seen_until = sent.counted_until(replica.name)
            replica.rank = load_rank(replica.seen)
            replica.load = None
        return replica.seen

    def snapshot(self) -> ClusterSnapshot:
        now = self.clock.now
        loads = {}
        for role, replicas in self.replicas.items():
            expected = tuple(self.expected[role].pending(now))
            if expected:
                loads[role] = tuple(replica_load(r.name, self._seen(role, r), r.healthy, expected) for r in replicas)
                continue
            for r in replicas:
                seen = self._seen(role, r)
                if r.load is None:
                    r.load = replica_load(r.name, seen, r.healthy, ())
            loads[role] = tuple(r.load for r in replicas)
        return ClusterSnapshot(loads["prefill"], loads["decode"])

    def _route(self, role: str) -> Replica | None:
        """Serve's request router with the app's ranking (app/flow/routing.py): lowest load rank, then fewest legs in
        flight, among the replicas alive; None if none is."""
        replicas = [r for r in self.replicas[role] if r.healthy]
        for replica in replicas:
            self._seen(role, replica)
        return min(replicas, key=lambda r: (r.rank, r.in_flight), default=None)

    def _send(self, role: str, replica: Replica, tokens: int) -> None:
        self.sent[role].add(replica.name, tokens, self.clock.now)
        replica.seen = None
        self.expected[role].taken(tokens, self.clock.now)
        replica.in_flight += 1

    # -- replicas dying and replaced ---------------------------------------------------------------------------

    def fail(self, role: str, index: int) -> None:
        """The replica dies now, with every leg it held; its replacement is up `replica_start_s` later."""
        replica = self.replicas[role][index]
        if not replica.healthy:
            return
        replica.healthy, replica.seen = False, None
        replica.engine.fail()
        self.clock.after(self.profile.replica_start_s, self._replaced, replica)

    def _replaced(self, replica: Replica) -> None:
        replica.engine.restart()
        replica.healthy, replica.seen = True, None

    def _lost(self, served: Served, decision: Decision, leg: SimRequest) -> None:
        """A leg of the request was lost with its replica (app/flow/request_flow.py's retries)."""
        role = next((role for role, (_, mine) in served.legs.items() if mine is leg), None)
        if role is None:
            return  # the request was already met: another of its legs was lost first
        replica, _ = served.legs.pop(role)
        replica.in_flight -= role != "held"
        if (served.mode == "pull" and role == "decode" and "held" in served.legs and len(served.token_times) == 1
                and served.reads < MAX_ATTEMPTS):
            # prefill still leases the KV: another decode replica READs it (the app's decode leg retries as often)
            self._pull_decode(served, decision)
            return
        self._drop_legs(served)
        if served.token_times or served.attempts >= MAX_ATTEMPTS:
            self._end(served, failed=True)
        else:
            self._decide(served, retry_mode=decision.mode)

    def _drop_legs(self, served: Served) -> None:
        """Cancel the request's legs: their blocks free, their replicas count them in flight no more."""
        for role, (replica, leg) in served.legs.items():
            replica.engine.abort(leg)
            replica.in_flight -= role != "held"
        served.legs.clear()

    # -- a request's life ---------------------------------------------------------------------------------------

    def run(self, arrivals: list[Arrival], drain_s: float) -> list[Served]:
        """Every arrival, then `drain_s` more for the last ones to finish; what the clients saw."""
        for arrival in arrivals:
            self.submit(arrival)
        self.clock.run(until=(arrivals[-1].at_s if arrivals else 0.0) + drain_s)
        return self.served

    def submit(self, arrival: Arrival) -> Served:
        served = Served(arrival, RequestTimeline(events={"arrival": arrival.at_s}))
        self.served.append(served)
        self.clock.at(arrival.at_s, self._arrive, served)
        return served

    def _arrive(self, served: Served) -> None:
        served.ticket, shed = self.admission.arrive(served.arrival.qos_class)
        for ticket in shed:
            del self.waiting[ticket]
        if served.ticket.state == RUNNING:
            self._start(served)
        elif served.ticket.state != SHED:
            self.waiting[served.ticket] = served
        self.clock.after(self.classes[served.arrival.qos_class].ttft_slo_ms / 1e3, self._ttft_passed, served)

    def _ttft_passed(self, served: Served) -> None:
        """As the ingress does: a request with no first token out by its class's TTFT objective is a miss then,
        waiting or running."""
        if served.ticket.state in (WAITING, RUNNING) and "first_token_sent" not in served.timeline.events:
            self.admission.judged(served.ticket, met=False)

    def _start(self, served: Served) -> None:
        self.clock.after(self.profile.hops.ingress_s, self._decide, served)

    def _decide(self, served: Served, retry_mode: str | None = None) -> None:
        """The policy's decision, or, for a request started again, the same mode on the replicas left."""
        arrival = served.arrival
        served.attempts += 1
        decision = self.policy.decide(RequestFeatures(arrival.prompt_tokens, arrival.max_tokens,
                                                      requested_mode=retry_mode, qos_class=arrival.qos_class),
                                      self.snapshot())
        served.mode, served.reason = decision.mode, decision.reason
        if decision.mode is None:  # no replica can take its legs: a 503
            self._end(served, failed=True)
            return
        self.expected["decode" if decision.mode == "local" else "prefill"].expect(arrival.prompt_tokens,
                                                                                 self.clock.now)
        served.timeline.events.setdefault("first_dispatch", self.clock.now)
        if decision.mode == "local":
            self._local(served, decision)
        else:
            self._remote(served, decision)

    def _request(self, served: Served, decision: Decision, role: str, replica: Replica, max_tokens: int,
                 **fields) -> SimRequest:
        """A leg of the request on `replica`, in flight from now."""
        arrival = served.arrival
        leg = SimRequest(f"{id(served)}", arrival.prompt_tokens, max_tokens, self.classes[arrival.qos_class].priority,
                         self.clock.now, on_lost=lambda r: self._lost(served, decision, r), **fields)
        served.legs[role] = (replica, leg)
        return leg

    def _local(self, served: Served, decision: Decision) -> None:
        replica = self.by_name[decision.decode_replica]
        self._send("decode", replica, served.arrival.prompt_tokens)
        leg = self._request(served, decision, "decode", replica, served.arrival.max_tokens,
                            on_token=lambda r, t: self._token(served, t, "decode", r),
                            on_finished=lambda r, t: self._leg_done(served, replica, decision))
        self.clock.after(self.profile.hops.to_engine_s, replica.engine.add, leg)

    def _remote(self, served: Served, decision: Decision) -> None:
        tokens, mode = served.arrival.prompt_tokens, decision.mode
        prefill = self._route("prefill")  # the policy decided on a healthy one: there is one
        self._send("prefill", prefill, tokens)
        served.timeline.events["prefill_dispatched"] = self.clock.now
        decode_leg = None
        state = {"prefilled": None, "registered": decision.mode != "push"}
        one_token = served.arrival.max_tokens <= 1

        def prefilled(leg: SimRequest, now: float) -> None:
            state["prefilled"] = leg
            self._engine_events(served, "prefill", leg, now)
            self._token(served, now, "prefill", leg)
            prefill.in_flight -= 1
            served.legs["held"] = served.legs.pop("prefill")
            if one_token:
                self._release(served)
                self._end(served, decision)
            elif mode == "pull":  # the ingress dispatches the decode leg once prefill answered
                self.clock.after(self.profile.hops.to_client_s, self._pull_decode, served, decision)
            elif state["registered"]:
                self._write(served, decision, decode_leg)

        if mode == "push" and not one_token:
            decode = self.by_name[decision.decode_replica]
            self._send("decode", decode, 0)

            def registered(leg: SimRequest, now: float) -> None:
                state["registered"] = True
                if state["prefilled"] is not None:
                    self._write(served, decision, leg)

            decode_leg = self._request(served, decision, "decode", decode, served.arrival.max_tokens,
                                       on_reserved=registered,
                                       on_token=lambda r, t: self._token(served, t, "decode", r),
                                       on_finished=lambda r, t: self._leg_done(served, decode, decision))
            self.clock.after(self.profile.hops.to_engine_s, decode.engine.reserve, decode_leg)
        leg = self._request(served, decision, "prefill", prefill, 1, hold_kv=True, on_finished=prefilled)
        self.clock.after(self.profile.hops.to_engine_s, prefill.engine.add, leg)

    def _pull_decode(self, served: Served, decision: Decision) -> None:
        if "held" not in served.legs:
            return  # its prefill replica died meanwhile
        decode = self._route("decode")
        if decode is None:
            self._drop_legs(served)
            self._end(served, failed=True)
            return
        self._send("decode", decode, 0)
        served.reads += 1
        served.timeline.events["decode_dispatched"] = self.clock.now

        def reserved(leg: SimRequest, now: float) -> None:
            self.clock.after(self.profile.handoff.seconds(served.arrival.prompt_tokens), read_done, leg)

        def read_done(leg: SimRequest) -> None:
            if self._in_flight(served, leg) and "held" in served.legs:  # neither end died during the READ
                self._release(served)
                decode.engine.kv_arrived(leg, served.arrival.prompt_tokens, generated=1)

        leg = self._request(served, decision, "decode", decode, served.arrival.max_tokens, on_reserved=reserved,
                            on_token=lambda r, t: self._token(served, t, "decode", r),
                            on_finished=lambda r, t: self._leg_done(served, decode, decision))
        self.clock.after(self.profile.hops.to_engine_s, decode.engine.reserve, leg)

    def _write(self, served: Served, decision: Decision, decode_leg: SimRequest) -> None:
        decode = self.by_name[decision.decode_replica]

        def written() -> None:
            if self._in_flight(served, decode_leg) and "held" in served.legs:  # neither end died during the WRITE
                self._release(served)
                # decode's prompt lacks the token prefill sampled: it computes the last prompt token again
                decode.engine.kv_arrived(decode_leg, served.arrival.prompt_tokens - 1, generated=0)

        self.clock.after(self.profile.handoff.seconds(served.arrival.prompt_tokens), written)

    def _token(self, served: Served, now: float, role: str, leg: SimRequest) -> None:
        if role == "decode" and served.mode == "push" and leg.generated == 1:
            return  # the token prefill sampled, already sent
        if role == "decode" and leg.generated == 1 and served.mode == "local":
            self._engine_events(served, "decode", leg, now)
        if role == "decode" and served.mode != "local" and "decode_scheduled" not in served.timeline.events:
            self._engine_events(served, "decode", leg, now)
        sent = now + self.profile.hops.to_client_s
        served.token_times.append(sent)
        served.timeline.events.setdefault("first_token_sent", sent)

    @staticmethod
    def _engine_events(served: Served, role: str, leg: SimRequest, first_token: float) -> None:
        events = served.timeline.events
        for event, at in (("queued", leg.queued_s), ("scheduled", leg.scheduled_s), ("first_token", first_token)):
            if at is not None:
                events.setdefault(f"{role}_{event}", at)

    @staticmethod
    def _in_flight(served: Served, leg: SimRequest) -> bool:
        """The leg is its request's decode leg still (not lost, nor one of an attempt given up)."""
        return served.legs.get("decode", (None, None))[1] is leg

    def _release(self, served: Served) -> None:
        """Prefill's KV has been taken: its blocks free."""
        replica, leg = served.legs.pop("held")
        replica.engine.release(leg)

    def _leg_done(self, served: Served, decode: Replica, decision: Decision) -> None:
        decode.in_flight -= 1
        del served.legs["decode"]
        self._end(served, decision)

    def _end(self, served: Served, decision: Decision | None = None, failed: bool = False) -> None:
        served.done, served.failed = not failed, failed
        if decision is not None and served.attempts == 1:  # a retried request's phases mix its attempts
            seen = Observation.from_phases(decision.mode, served.arrival.prompt_tokens, decision,
                                           served.timeline.phases())
            if seen is not None:
                self.policy.model.observe(seen)
        if served.token_times or failed:
            self.admission.judged(served.ticket, not failed and self.classes[served.arrival.qos_class].met(
                served.ttft_s, served.tpot_s))
        for ticket in self.admission.leave(served.ticket):
            self._start(self.waiting.pop(ticket))
