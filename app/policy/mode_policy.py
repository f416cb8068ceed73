"""Which way a request travels -- push, pull or local -- predicted from its prompt and the cluster's load, and why.

Pure: no Ray, no vLLM, no I/O, no clock. The ingress calls it once a prompt is tokenized; a simulator can run the
same code against modelled engines.

The cost of each option is two numbers, in seconds:
- ttft: hop (the option's fixed path cost) + queue (tokens already queued on the engine that prefills, at the rate
  that engine's queue drains) + prefill (a step's fixed part and the prompt's tokens at that engine's rate) + the
  hand-off, when the first token is not seeded by prefill (it then waits for the KV on decode);
- stall: the gap the option adds between two tokens of any one stream -- what a stream's user sees, and what an
  inter-token latency SLO bounds, stream by stream. A local prefill on a decode engine holds each of its running
  streams for its prompt's per-token part (the step's fixed part they would wait for anyway), or, where that engine
  computes a long prompt in chunks while others run (`decode_chunk_tokens`), for one chunk's; a hand-off holds them
  for one admission step; a seeded remote request's own second token waits for its hand-off (a seeded request of
  one token is answered by prefill alone: no stall).
The option with the lowest `ttft_weight(class) * ttft + stall_weight * stall * held` wins: every user's seconds of
waiting, where `held` is how many streams wait out the stall. A local prefill's falls on every stream decoding on
its replica -- its compute is in each of their steps; a hand-off's is counted once: its admission is one more row in
a step those streams take anyway, and its own second token is one stream.
Push is taken only where it holds little: it binds a decode slot and blocks at arrival, so not while prefill's
queue would keep them idle.

The `threshold` policy is the fixed rule instead (`ThresholdRule`): local for a short prompt or while every prefill
engine is backed up, else the rule's remote mode. It learns nothing and reads only prefill's queue.

The coefficients start from configuration and are learned from what requests report (`CostModel.observe`): each
role's prefill time as a fixed step cost plus seconds per prompt token (`PrefillFit`, a least-squares line over the
prompt lengths seen), kept per load level (how many streams decode is decoding), because where the serving stack
shares cores with the engines a prefill slows while decode is busy; the hand-off's seconds per KV byte;
and each mode's fixed cost (the part of its TTFT that no token count explains). An option that has not been seen at
the current load level is tried now and then (`explore`), so a rate that changed with load is learned, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

Mode = Literal["push", "pull", "local"]
MODES: tuple[Mode, ...] = ("push", "pull", "local")
Policy = Literal["auto", "threshold"]
# Every way the app serves a request: always one mode, or a policy choosing one per request.
SERVING: tuple[Mode | Policy, ...] = (*MODES, "threshold", "auto")
Role = Literal["prefill", "decode"]

# Why a request went the way it did (the `x-kv-transfer-reason` header, the metrics label).
REQUESTED = "requested"  # the client named the mode
CONFIGURED = "configured"  # the policy is a fixed mode
LOWEST_COST = "lowest_cost"  # auto: the option predicted cheapest
EXPLORE = "explore"  # auto: an option not yet measured at this load, tried so that its cost is learned
RULE = "rule"  # threshold: the prompt's length and prefill's queue chose it
PREFILL_UNAVAILABLE = "prefill_unavailable"  # no prefill replica can take it: local (auto), or refused (503)
DECODE_UNAVAILABLE = "decode_unavailable"  # no decode replica can take it: refused (503)
PUSH_UNSUPPORTED = "push_unsupported"  # the request needs something push cannot carry: pull instead
REASONS = (REQUESTED, CONFIGURED, LOWEST_COST, EXPLORE, RULE, PREFILL_UNAVAILABLE, DECODE_UNAVAILABLE, PUSH_UNSUPPORTED)

# Load levels: streams decoding, in powers of two (0, 1, 2-3, 4-7, ..., 64 and more).
LOAD_LEVELS = 8


def load_level(streams: int) -> int:
    return min(max(streams, 0).bit_length(), LOAD_LEVELS - 1)


@dataclass(frozen=True)
class RequestFeatures:
    prompt_tokens: int  # counted after tokenizing
    max_tokens: int
    requested_mode: Mode | Policy | None = None  # the client's choice; None: the configured policy's
    qos_class: str = "interactive"
    seeded: bool = True  # whether a disaggregated answer's first token comes from prefill (app/flow/first_token.py)
    push_capable: bool = True  # False for a request that needs something push cannot carry


@dataclass(frozen=True)
class ReplicaLoad:
    replica: str
    healthy: bool = True
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens admitted but not yet computed
    kv_cache_usage: float = 0.0  # 0..1
    decoding: int = 0  # decode: streams past their prefill


@dataclass(frozen=True)
class ClusterSnapshot:
    prefill: tuple[ReplicaLoad, ...]
    decode: tuple[ReplicaLoad, ...]


@dataclass(frozen=True)
class OptionCost:
    ttft_s: float
    stall_s: float
    score: float


@dataclass(frozen=True)
class Decision:
    mode: Mode | None  # None: refused (no decode replica can take it)
    reason: str
    decode_replica: str | None = None  # push and local bind decode now; pull binds it after prefill
    costs: Mapping[Mode, OptionCost] = field(default_factory=dict)
    decoding: int = 0  # the streams the chosen mode's prefill runs beside: its observation's load (Observation)
    queued_tokens: int = 0  # prompt tokens queued ahead on the engine that prefills: what its queue wait drains
    ruled_out: tuple[Mode, ...] = ()  # options costed but kept out by a limit (push while it would hold decode idle)


@dataclass(frozen=True)
class CostPriors:
    """Where the learned coefficients start, and the model's weights: the app's `ingress.mode_policy` section. The
    defaults are this project's tiny model on this project's CPU machines; the rates are learned online from there,
    the weights and limits are kept."""

    prefill_s_per_token: float = 1.1e-4  # a prefill engine, idle
    local_prefill_s_per_token: float = 1.2e-4  # a decode engine prefilling a prompt itself, idle
    hop_s: Mapping[Mode, float] = field(default_factory=lambda: {"push": 0.015, "pull": 0.01, "local": 0.008})
    handoff_fixed_s: float = 0.01  # a READ or WRITE of any size, and its notices
    handoff_s_per_byte: float = 1 / 2e9
    kv_bytes_per_token: int = 4096  # layers x KV heads x head size x 2 (K and V) x dtype bytes
    admit_step_s: float = 0.01  # one decode step that takes a new request's KV in
    stall_weight: float = 1.0  # a second of a stream's stall against a second of the new request's TTFT
    push_kv_limit: float = 0.9  # push holds decode blocks while prefill runs: not onto a decode fuller than this
    # Push holds a decode slot and blocks from arrival: not while the prompts queued at prefill ahead of it would keep
    # them idle longer than this (under load that idles decode's slots, and every mode's requests wait for them).
    push_queue_limit_s: float = 0.05
    learning_rate: float = 0.2  # weight of each new observation in the learned coefficients
    min_samples: int = 3  # an option seen fewer times than this at a load level is worth exploring there
    explore_every: int = 20  # at most one exploring decision in this many

    def __post_init__(self):
        if set(self.hop_s) != set(MODES) or min(self.hop_s.values()) < 0:
            raise ValueError(f"hop_s needs a non-negative cost for each of {list(MODES)}, got {dict(self.hop_s)}")
        if self.stall_weight < 0:
            raise ValueError("stall_weight must not be negative")
        if not 0 < self.learning_rate <= 1:
            raise ValueError(f"learning_rate must be in (0, 1], got {self.learning_rate}")


@dataclass(frozen=True)
class ThresholdRule:
    """The `threshold` policy's rule: the app's `ingress.threshold_rule` section."""

    local_below_tokens: int = 1000  # a prompt shorter than this is prefilled by decode itself
    prefill_queue_tokens: int = 4096  # local too while the least busy prefill engine has this many tokens queued
    remote_mode: Mode = "pull"  # how every other request travels

    def __post_init__(self):
        if self.remote_mode == "local":
            raise ValueError("remote_mode must be push or pull")
        if min(self.local_below_tokens, self.prefill_queue_tokens) < 0:
            raise ValueError("the rule's token limits must not be negative")


@dataclass(frozen=True)
class Observation:
    """What one finished request tells the model (from its timeline)."""

    mode: Mode
    prompt_tokens: int
    decoding: int  # streams decoding on the engine that prefilled (local) or in the cluster (push, pull)
    prefill_s: float  # the engine's compute of the prompt
    ttft_s: float | None = None  # ingress-stamped; with the queue and prefill removed, it teaches the mode's hop
    queue_s: float = 0.0  # in the prefilling engine's queue
    handoff_s: float | None = None  # push and pull: the KV's crossing
    queued_tokens: int = 0  # prompt tokens queued ahead of it there when it was decided (Decision.queued_tokens)

    @staticmethod
    def from_phases(mode: Mode, prompt_tokens: int, decision: Decision, phases: Mapping[str, float]
                    ) -> Observation | None:
        """From a served request's decision and phases in seconds (app/flow/timeline.py's names); None where its prefill
        went unseen."""
        local = mode == "local"
        prefill_s = phases.get("decode_first_step" if local else "prefill_compute")
        if prefill_s is None:
            return None
        return Observation(mode, prompt_tokens, decision.decoding, prefill_s, phases.get("ttft"),
                           phases.get("kv_wait" if local else "prefill_queue", 0.0),
                           phases.get("kv_wait") if mode == "pull" else None, decision.queued_tokens)


@dataclass(frozen=True)
class PrefillCost:
    step_s: float  # the fixed part: what a step costs whatever the prompt
    s_per_token: float

    def __call__(self, tokens: int) -> float:
        return self.step_s + tokens * self.s_per_token


class PrefillFit:
    """Prefill seconds against prompt tokens, a line fitted by exponentially weighted least squares: each new
    observation weighs as much as `learning_rate` of all before it."""

    def __init__(self, learning_rate: float):
        self.keep = 1 - learning_rate
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.cost = PrefillCost(0.0, 0.0)  # the fitted line, refitted at each observation

    def add(self, tokens: int, seconds: float) -> None:
        k = self.keep
        self.w, self.x, self.y = k * self.w + 1, k * self.x + tokens, k * self.y + seconds
        self.xx, self.xy = k * self.xx + tokens * tokens, k * self.xy + tokens * seconds
        self.cost = self._fit()

    def _fit(self) -> PrefillCost:
        """Through the origin while the lengths seen are too alike to separate the step from the tokens, or where
        the fit would give a part below zero."""
        spread = self.w * self.xx - self.x * self.x
        if spread > 1e-9 * self.w * self.xx:
            per_token = (self.w * self.xy - self.x * self.y) / spread
            step = (self.y - per_token * self.x) / self.w
            if per_token > 0 and step >= 0:
                return PrefillCost(step, per_token)
        return PrefillCost(0.0, self.y / self.x)


# A queue wait teaches the drain rate only behind at least this many tokens: behind fewer, the wait is mostly the
# step in progress, whatever the tokens.
MIN_QUEUED_TOKENS = 512


class CostModel:
    """The learned coefficients: each an exponentially weighted average of what requests reported."""

    def __init__(self, priors: CostPriors):
        self.priors = priors
        self.fits: dict[tuple[Role, int], PrefillFit] = {}  # (engine role, load level) -> prefill time vs tokens
        self.drains: dict[tuple[Role, int], float] = {}  # (engine role, load level) -> seconds per queued token
        self.samples: dict[tuple[Mode, int], int] = {}  # (mode, load level) -> observations
        self.hop_s: dict[Mode, float] = dict(priors.hop_s)
        self.handoff_s_per_byte = priors.handoff_s_per_byte

    def _blend(self, old: float, new: float) -> float:
        return old + self.priors.learning_rate * (new - old)

    def prefill(self, role: Role, level: int) -> PrefillCost:
        """A prefill on `role`'s engine at `level`: learned there, else at the nearest level below that was seen
        (load slows an engine, never speeds it), else the prior."""
        for at in range(level, -1, -1):
            if (role, at) in self.fits:
                return self.fits[role, at].cost
        return PrefillCost(0.0, self.priors.local_prefill_s_per_token if role == "decode"
                           else self.priors.prefill_s_per_token)

    def queue_s_per_token(self, role: Role, level: int) -> float:
        """How fast tokens queued on `role`'s engine at `level` drain: learned from what queued requests waited,
        else the prefill rate. The two differ where an engine batches prompts: a prompt's own prefill takes about
        a step whatever its length, while a queue drains a step's token budget a step."""
        for at in range(level, -1, -1):
            if (role, at) in self.drains:
                return self.drains[role, at]
        return self.prefill(role, level).s_per_token

    def handoff_s(self, prompt_tokens: int) -> float:
        return self.priors.handoff_fixed_s + prompt_tokens * self.priors.kv_bytes_per_token * self.handoff_s_per_byte

    def observe(self, seen: Observation) -> None:
        role: Role = "decode" if seen.mode == "local" else "prefill"
        level = load_level(seen.decoding)
        key = (seen.mode, level)
        self.samples[key] = self.samples.get(key, 0) + 1
        if seen.prompt_tokens > 0 and seen.prefill_s > 0:
            self.fits.setdefault((role, level), PrefillFit(self.priors.learning_rate)).add(
                seen.prompt_tokens, seen.prefill_s)
        if seen.queued_tokens >= MIN_QUEUED_TOKENS:
            drain = seen.queue_s / seen.queued_tokens
            self.drains[role, level] = self._blend(self.drains.get((role, level), drain), drain)
        if seen.handoff_s is not None and seen.prompt_tokens > 0:
            kv_bytes = seen.prompt_tokens * self.priors.kv_bytes_per_token
            per_byte = max(seen.handoff_s - self.priors.handoff_fixed_s, 0.0) / kv_bytes
            self.handoff_s_per_byte = self._blend(self.handoff_s_per_byte, per_byte)
        if seen.ttft_s is not None:
            hop = max(seen.ttft_s - seen.queue_s - seen.prefill_s, 0.0)
            self.hop_s[seen.mode] = self._blend(self.hop_s[seen.mode], hop)


@dataclass(frozen=True)
class PolicyConfig:
    policy: Policy | Mode = "auto"
    modes: tuple[Mode, ...] = MODES  # the modes the engines serve (local always)
    priors: CostPriors = CostPriors()
    rule: ThresholdRule = ThresholdRule()
    decode_chunk_tokens: int | None = None  # the most prompt tokens a decode engine computes for one request a step
    # Per service class: its own TTFT's weight against the stall it imposes (a class not named weighs 1).
    ttft_weight: Mapping[str, float] = field(default_factory=lambda: {"interactive": 1.0, "batch": 0.25})


class ModePolicy:
    def __init__(self, config: PolicyConfig):
        if config.policy not in ("auto", "threshold", *config.modes):
            raise ValueError(f"policy {config.policy!r} is not among the modes served: {list(config.modes)}")
        if config.rule.remote_mode not in config.modes:
            raise ValueError(f"the threshold rule's remote mode {config.rule.remote_mode!r} is not served")
        self.config = config
        self.model = CostModel(config.priors)
        self._since_explore = 0

    def decide(self, request: RequestFeatures, cluster: ClusterSnapshot) -> Decision:
        requested = request.requested_mode
        if requested not in (None, "auto", "threshold", *self.config.modes):
            raise ValueError(f"mode {requested!r} is not served: {list(self.config.modes)}")
        best = _best_replicas(cluster)
        if best.decode is None:
            return Decision(None, DECODE_UNAVAILABLE)
        named = self.config.policy if requested is None else requested
        fixed = None if named in ("auto", "threshold") else named
        if fixed != "local" and best.prefill is None:
            # A mode the client or the configuration named is obeyed, or refused; a policy serves it without prefill.
            if fixed is not None:
                return Decision(None, PREFILL_UNAVAILABLE)
            return self._decided("local", PREFILL_UNAVAILABLE, request, best)
        if fixed == "push" and not request.push_capable:
            return self._decided("pull", PUSH_UNSUPPORTED, request, best)
        if fixed is not None:
            return self._decided(fixed, CONFIGURED if requested is None else REQUESTED, request, best)
        if named == "threshold":
            return self._decided(self._by_rule(request, best), RULE, request, best)
        return self._auto(request, best)

    def costs(self, request: RequestFeatures, cluster: ClusterSnapshot) -> dict[Mode, OptionCost]:
        """Each served option's predicted cost (a disaggregated one only while a prefill replica is up)."""
        return self._costs(request, _best_replicas(cluster))

    def _auto(self, request: RequestFeatures, best: _BestReplicas) -> Decision:
        costs = self._costs(request, best)
        options = [mode for mode in costs if mode != "push" or self._push_holds_little(request, best)]
        ruled_out = tuple(mode for mode in costs if mode not in options)
        cheapest = min(options, key=lambda m: costs[m].score)
        self._since_explore += 1
        if self._since_explore >= self.config.priors.explore_every:
            # The cheapest option is measured by being taken; another one taken too rarely at this load is taken
            # now (the least seen, then the cheapest of those).
            samples = {mode: self.model.samples.get((mode, load_level(best.streams(mode))), 0) for mode in options}
            unseen = [m for m in options if m != cheapest and samples[m] < self.config.priors.min_samples]
            if unseen:
                self._since_explore = 0
                mode = min(unseen, key=lambda m: (samples[m], costs[m].score))
                return best.decision(mode, EXPLORE, costs, ruled_out)
        return best.decision(cheapest, LOWEST_COST, costs, ruled_out)

    def _push_holds_little(self, request: RequestFeatures, best: _BestReplicas) -> bool:
        """Push binds a decode replica's slot and blocks at arrival: only where they are free (KV under
        `push_kv_limit`) and prefill would start the prompt soon (its queue under `push_queue_limit_s`)."""
        priors = self.config.priors
        drain = self.model.queue_s_per_token("prefill", load_level(best.streams("push")))
        return (request.push_capable and best.decode.kv_cache_usage <= priors.push_kv_limit
                and best.queued("push") * drain <= priors.push_queue_limit_s)

    def _local_chunk(self, prompt_tokens: int) -> int:
        """The most of the prompt a decode engine computes in one step."""
        return min(prompt_tokens, self.config.decode_chunk_tokens or prompt_tokens)

    def _by_rule(self, request: RequestFeatures, best: _BestReplicas) -> Mode:
        rule = self.config.rule
        if request.prompt_tokens < rule.local_below_tokens \
                or best.prefill.queued_prefill_tokens >= rule.prefill_queue_tokens:
            return "local"
        return "pull" if rule.remote_mode == "push" and not request.push_capable else rule.remote_mode

    def _decided(self, mode: Mode, reason: str, request: RequestFeatures, best: _BestReplicas) -> Decision:
        return best.decision(mode, reason, self._costs(request, best))

    def _costs(self, request: RequestFeatures, best: _BestReplicas) -> dict[Mode, OptionCost]:
        priors, model, decode = self.config.priors, self.model, best.decode
        weight = self.config.ttft_weight.get(request.qos_class, 1.0)
        tokens = request.prompt_tokens
        costs: dict[Mode, OptionCost] = {}
        for mode in self.config.modes:
            if mode == "local":
                level = load_level(best.streams(mode))
                prefill = model.prefill("decode", level)
                ttft = (model.hop_s["local"] + best.queued(mode) * model.queue_s_per_token("decode", level)
                        + prefill(tokens))
                stall = self._local_chunk(tokens) * prefill.s_per_token if decode.decoding else 0.0
                held = decode.decoding
            elif best.prefill is None:
                continue
            else:
                level = load_level(best.streams(mode))
                prefill = model.prefill("prefill", level)
                handoff = model.handoff_s(tokens)
                ttft = (model.hop_s[mode] + best.queued(mode) * model.queue_s_per_token("prefill", level)
                        + prefill(tokens))
                stall, held = priors.admit_step_s if decode.decoding else 0.0, 1
                if request.seeded and request.max_tokens <= 1:
                    stall = 0.0  # answered by prefill alone: no decode leg, no hand-off
                elif request.seeded:
                    stall = max(stall, handoff)  # the request's own second token waits for its KV
                else:
                    ttft += handoff + priors.admit_step_s
            costs[mode] = OptionCost(ttft, stall, weight * ttft + priors.stall_weight * stall * held)
        return costs


@dataclass(frozen=True)
class _BestReplicas:
    prefill: ReplicaLoad | None  # the healthy prefill replica with the fewest tokens queued
    decode: ReplicaLoad | None  # the healthy decode replica a new stream disturbs least
    decoding: int  # streams decoding on all healthy decode replicas

    def streams(self, mode: Mode) -> int:
        """The streams decoding beside `mode`'s prefill, which set its load level (and its observation's,
        CostModel.observe): the decode replica's own for local; the cluster's for a prefill engine, which shares
        cores with them where engines share a node."""
        return self.decode.decoding if mode == "local" else self.decoding

    def bound(self, mode: Mode) -> str | None:
        """The decode replica a `mode` request is bound to now: push and local bind it; pull binds it after
        prefill."""
        return None if mode == "pull" else self.decode.replica

    def queued(self, mode: Mode) -> int:
        """Prompt tokens queued ahead on the engine that would prefill a `mode` request."""
        return self.decode.queued_prefill_tokens if mode == "local" else self.prefill.queued_prefill_tokens

    def decision(self, mode: Mode, reason: str, costs: Mapping[Mode, OptionCost], ruled_out: tuple[Mode, ...] = ()
                 ) -> Decision:
        return Decision(mode, reason, self.bound(mode), costs, self.streams(mode), self.queued(mode), ruled_out)


def _best_replicas(cluster: ClusterSnapshot) -> _BestReplicas:
    """One pass over each role's replicas: at 64 x 64 this scan is most of a decision's time."""
    prefill = min((replica for replica in cluster.prefill if replica.healthy),
                  key=lambda replica: replica.queued_prefill_tokens, default=None)
    decode, decoding, least = None, 0, 0
    for replica in cluster.decode:
        if replica.healthy:
            decoding += replica.decoding
            # The decode replica a new stream disturbs least: fewest streams and waiting requests, then the
            # emptiest KV; the first listed among equals. (Compared field by field: no tuple per replica.)
            load = replica.decoding + replica.waiting
            if decode is None or load < least or (load == least and replica.kv_cache_usage < decode.kv_cache_usage):
                decode, least = replica, load
    return _BestReplicas(prefill, decode, decoding)
