"""One vLLM engine, modelled as its scheduler works: steps back to back while it has work; each step takes the
running requests first (a token each while decoding, the next chunk while prefilling), then waiting ones in
priority order, within a token budget and a limit of running requests; KV blocks are allocated as tokens are
scheduled, and when they run out the running request that comes last in priority order is preempted (its blocks
freed, its prompt and output so far computed again later). A step's duration comes from the profile's cost of what
it computed; its tokens come out when it ends. An engine can die (`fail`): every request it holds is lost at once,
and it takes nothing until `restart`ed empty, as a replacement replica."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from sim.clock import Clock


@dataclass(frozen=True)
class StepCost:
    """Seconds per engine step: fixed + per prompt token computed + per decoding request + per context token the
    decoding requests attend to."""

    fixed_s: float
    prefill_s_per_token: float
    decode_s_per_request: float = 0.0
    context_s_per_token: float = 0.0

    def __call__(self, prefill_tokens: int, decoding: int, context_tokens: int) -> float:
        return (self.fixed_s + self.prefill_s_per_token * prefill_tokens + self.decode_s_per_request * decoding
                + self.context_s_per_token * context_tokens)


@dataclass(frozen=True)
class EngineSpec:
    """An engine's scheduler limits and step cost (vLLM's max_num_seqs, max_num_batched_tokens,
    long_prefill_token_threshold, block size and KV blocks)."""

    step: StepCost
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0: a prompt's chunk is bounded by the budget alone
    block_size: int = 16
    num_blocks: int = 100_000
    priority_scheduling: bool = True  # False: first come, first served

    @property
    def chunk_tokens(self) -> int:
        """The most prompt tokens one request computes in a step."""
        return min(self.long_prefill_token_threshold or self.max_num_batched_tokens, self.max_num_batched_tokens)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    arrival_s: float = 0.0
    on_token: Callable[[SimRequest, float], None] | None = None  # each token, when its step ends
    on_finished: Callable[[SimRequest, float], None] | None = None
    on_reserved: Callable[[SimRequest, float], None] | None = None  # blocks for a prompt whose KV comes from elsewhere
    on_lost: Callable[[SimRequest], None] | None = None  # its engine died with it (or was dead when it came)
    hold_kv: bool = False  # finished, keep the blocks until released (prefill's KV, until decode has it)
    aborted: bool = False
    computed: int = 0  # tokens whose KV the engine holds
    generated: int = 0
    blocks: int = 0
    preemptions: int = 0
    queued_s: float | None = None  # when the engine got it (to reserve blocks in, for one whose KV comes)
    scheduled_s: float | None = None  # its first step since
    token_times: list[float] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next token is sampled: the prompt and every token generated so far, less
        what the engine holds (one, the newest token, while decoding)."""
        return self.prompt_tokens + self.generated - self.computed

    @property
    def prefilling(self) -> bool:
        """A prompt (or, after a preemption, a prompt and its output so far) being computed."""
        return self.generated == 0 or self.remaining > 1

    def order(self) -> tuple[int, float]:
        return self.priority, self.arrival_s


class EngineModel:
    def __init__(self, name: str, spec: EngineSpec, clock: Clock):
        self.name, self.spec, self.clock = name, spec, clock
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.free_blocks = spec.num_blocks
        self.reserving: list[SimRequest] = []  # waiting for blocks to take KV from elsewhere into
        self.awaiting: set[SimRequest] = set()  # blocks reserved, the KV not here yet
        self.held: set[SimRequest] = set()  # finished, KV kept for a transfer
        self.busy = False
        self.steps = 0
        self.legs_taken = 0
        self.alive = True
        self.life = 0  # how many times it was restarted: a step begun in an earlier life never ends

    def fail(self) -> None:
        """The engine dies: every request it held is lost."""
        lost = [*self.reserving, *self.awaiting, *self.waiting, *self.running, *self.held]
        self.alive, self.busy = False, False
        self.waiting, self.running, self.reserving, self.awaiting, self.held = [], [], [], set(), set()
        for request in lost:
            self._lose(request)

    def restart(self) -> None:
        """Up again, empty, as a new replica."""
        self.alive, self.life, self.free_blocks = True, self.life + 1, self.spec.num_blocks

    @staticmethod
    def _lose(request: SimRequest) -> None:
        request.blocks = 0
        if request.on_lost:
            request.on_lost(request)

    # -- what the rest of the simulation sees ----------------------------------------------------------------

    def add(self, request: SimRequest) -> None:
        if request.aborted:
            return
        if not self.alive:
            return self._lose(request)
        self.legs_taken += 1
        request.queued_s = self.clock.now
        self.waiting.append(request)
        self._wake()

    def reserve(self, request: SimRequest) -> None:
        """Blocks for the prompt of a request whose KV comes from another engine, as soon as they are free (then
        `on_reserved`); the request stays out of the scheduler until `kv_arrived`."""
        if request.aborted:
            return
        if not self.alive:
            return self._lose(request)
        self.legs_taken += 1
        request.queued_s = self.clock.now
        self.reserving.append(request)
        self._reserve_waiting()

    def kv_arrived(self, request: SimRequest, tokens: int, generated: int) -> None:
        """The prompt's KV is here (`tokens` of it) and `generated` tokens were sampled elsewhere: schedule it."""
        if not self.alive:
            return  # lost with the engine already
        self.awaiting.discard(request)
        request.computed, request.generated = tokens, generated
        self.waiting.append(request)
        self._wake()

    def release(self, request: SimRequest) -> None:
        """A held request's KV has been taken (or its lease ended): free its blocks."""
        if request in self.held:
            self.held.remove(request)
            self._free(request)

    def abort(self, request: SimRequest) -> None:
        """The request is cancelled: its blocks free, no more tokens; one still on its way is dropped when it comes."""
        request.aborted = True
        for queue in (self.waiting, self.running, self.reserving, self.awaiting):
            if request in queue:
                queue.remove(request)
                self._free(request)
        self.release(request)

    def report(self) -> dict[str, float]:
        """What the engine's replica reports for routing (app/engine/server.py `load`), but the time stamp."""
        return {"running": len(self.running), "waiting": len(self.waiting) + len(self.reserving),
                "kv_cache_usage": round(self.kv_usage, 3), "queued_prefill_tokens": self.queued_prefill_tokens,
                "decoding": self.decoding, "legs_taken": self.legs_taken}

    @property
    def queued_prefill_tokens(self) -> int:
        return sum(r.remaining for r in (*self.waiting, *self.running) if r.prefilling)

    @property
    def decoding(self) -> int:
        return sum(not r.prefilling for r in self.running)

    @property
    def kv_usage(self) -> float:
        return 1 - self.free_blocks / self.spec.num_blocks

    # -- the scheduler ----------------------------------------------------------------------------------------

    def _wake(self) -> None:
        if not self.busy and (self.waiting or self.running):
            self.busy = True
            self.clock.after(0.0, self._step)

    def _step(self) -> None:
        plan = self._schedule()
        if not plan:
            self.busy = False
            return
        prefill = sum(n for r, n in plan if r.prefilling)
        decoding = [r for r, _ in plan if not r.prefilling]
        duration = self.spec.step(prefill, len(decoding), sum(r.computed for r in decoding))
        for request, _ in plan:
            if request.scheduled_s is None:
                request.scheduled_s = self.clock.now
        self.steps += 1
        self.clock.after(duration, self._step_done, plan, self.life)

    def _schedule(self) -> list[tuple[SimRequest, int]]:
        spec, budget, plan = self.spec, self.spec.max_num_batched_tokens, []
        preempted = False
        running = sorted(self.running, key=SimRequest.order) if spec.priority_scheduling else list(self.running)
        for request in running:
            if budget == 0:
                break
            if request not in self.running:
                continue  # preempted for an earlier one this step
            n = self._chunk(request, budget)
            while not self._allocate(request, n):
                victim = self._victim()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                plan.append((request, n))
                budget -= n
        if not preempted:
            self.waiting.sort(key=SimRequest.order if spec.priority_scheduling else lambda r: r.arrival_s)
            while self.waiting and budget > 0 and len(self.running) < spec.max_num_seqs:
                request = self.waiting[0]
                n = self._chunk(request, budget)
                if not self._allocate(request, n):
                    break
                self.waiting.pop(0)
                self.running.append(request)
                plan.append((request, n))
                budget -= n
        return plan

    def _chunk(self, request: SimRequest, budget: int) -> int:
        n = min(request.remaining, self.spec.chunk_tokens) if request.prefilling else request.remaining
        return min(n, budget)

    def _allocate(self, request: SimRequest, tokens: int) -> bool:
        need = self.spec.blocks_for(request.computed + tokens) - request.blocks
        if need > self.free_blocks:
            return False
        self.free_blocks -= max(need, 0)
        request.blocks += max(need, 0)
        return True

    def _victim(self) -> SimRequest:
        if self.spec.priority_scheduling:
            return max(self.running, key=SimRequest.order)
        return self.running[-1]

    def _preempt(self, request: SimRequest) -> None:
        self.running.remove(request)
        self._free(request)
        request.computed = 0
        request.preemptions += 1
        self.waiting.append(request)

    def _free(self, request: SimRequest) -> None:
        self.free_blocks += request.blocks
        request.blocks = 0
        if self.reserving and request.blocks == 0:
            self.clock.after(0.0, self._reserve_waiting)

    def _reserve_waiting(self) -> None:
        while self.reserving:
            request = self.reserving[0]
            if not self._allocate(request, request.prompt_tokens):
                return
            self.reserving.pop(0)
            self.awaiting.add(request)
            if request.on_reserved:
                request.on_reserved(request, self.clock.now)

    def _step_done(self, plan: list[tuple[SimRequest, int]], life: int) -> None:
        if not self.alive or life != self.life:
            return  # the engine died during the step
        now = self.clock.now
        for request, n in plan:
            if request not in self.running:
                continue  # aborted during the step
            request.computed += n
            if request.remaining:
                continue  # a chunk of a prompt: no token yet
            request.generated += 1
            request.token_times.append(now)
            if request.on_token:
                request.on_token(request, now)
            if request.generated >= request.max_tokens:
                self.running.remove(request)
                if request.hold_kv:
                    self.held.add(request)
                else:
                    self._free(request)
                if request.on_finished:
                    request.on_finished(request, now)
        self.busy = False
        self._wake()
