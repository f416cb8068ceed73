"""Session fixtures: the colocated reference outputs, then one real Ray cluster running the app with real engines."""

from __future__ import annotations

import contextlib
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import yaml

from app.tiny_model import corpus_lines

ROOT = Path(__file__).resolve().parents[1]
CPU_CONFIG = ROOT / "configs" / "cpu-tiny.yaml"
APP_NAME = "pd"
ROLES = ("prefill", "decode")
# Short lifetimes keep the lease and timeout tests quick; everything else is the CPU default.
LEASE_S = 4
PUSH_TIMEOUT_S = 10  # a burst of 20 requests keeps the one prefill core busy for several seconds
OWN_APP_START_S = 600  # a hang bound: engines of a module's own app start in 1-2 min on these cores
REFERENCE_LOGPROBS = 5  # each reference token carries its top-5 logprobs (tests/test_logprobs.py)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """test_make_serve runs first, while no other Ray runs on the machine, as on a user's: a second cluster's dashboard
    agent cannot bind Ray's fixed agent port (52365, which ray.init cannot move) while the session's cluster holds it,
    and without that agent the README's `ray job submit` answers "No available agent to submit job"."""
    items.sort(key=lambda item: item.module.__name__ != "test_make_serve")  # stable: the rest keep their order


@dataclass(frozen=True)
class Case:
    """One greedy request: either a completion prompt or a chat conversation."""

    name: str
    max_tokens: int
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    schema: dict | None = None  # a JSON schema the answer follows (`response_format`; the reference's grammar)


def _text(first_line: int, num_lines: int) -> str:
    return " ".join(corpus_lines()[first_line:first_line + num_lines])


CASES = [
    Case("short", 24, prompt="The user asks the assistant"),
    Case("medium", 24, prompt=_text(0, 20)),
    Case("long", 16, prompt=_text(100, 110)),  # > 1,024 tokens: more than 8 KV blocks of 128
    Case("chat-short", 24, messages=({"role": "user", "content": "Tell me about the sea."},)),
    Case("chat-long", 16, messages=(
        {"role": "system", "content": _text(300, 10)},
        {"role": "user", "content": _text(400, 90)},
    )),
]

# Answers held to a JSON schema (tests/test_structured_outputs.py), the colocated engine's under the same grammar.
STRUCTURED_CASES = [
    Case("json-chat", 48, messages=({"role": "user", "content": "Is the sea deep? Answer in JSON."},), schema={
        "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"], "additionalProperties": False}),
    Case("json-long", 48, prompt=_text(100, 110), schema={
        "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
        "additionalProperties": False}),
]


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from app.tiny_model import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model())


def prompt_token_ids(tokenizer, case: Case) -> list[int]:
    if case.prompt is not None:
        return tokenizer.encode(case.prompt)
    text = tokenizer.apply_chat_template(list(case.messages), add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="session")
def reference_outputs(tokenizer) -> dict[str, dict[str, Any]]:
    """Computed before the app starts, in a separate process, so the reference engine never shares cores."""
    from bench.colocated_reference import colocated_outputs

    cases = CASES + STRUCTURED_CASES
    prompts = [{"prompt_token_ids": prompt_token_ids(tokenizer, c), "max_tokens": c.max_tokens,
                "logprobs": REFERENCE_LOGPROBS, "json_schema": c.schema} for c in cases]
    outputs = colocated_outputs(CPU_CONFIG, prompts)
    return {case.name: {**out, "prompt_token_ids": p["prompt_token_ids"]}
            for case, out, p in zip(cases, outputs, prompts)}


@dataclass
class RunningApp:
    base_url: str
    handles: dict[str, Any]
    metrics_url: str  # Ray's Prometheus export for this node
    dashboard_url: str  # Ray's dashboard, which takes job submissions

    def engine_call(self, role: str, method: str) -> Any:
        return getattr(self.handles[role], method).remote().result()

    def totals(self) -> dict[str, dict]:
        return {role: self.engine_call(role, "transfer_totals") for role in ROLES}

    def wait_for_totals(self, done: Callable[[dict], bool], timeout_s: float = 5.0) -> dict[str, dict]:
        """Engine counters are updated by vLLM's stats loop, a moment after the response is sent."""
        return wait_until(self.totals, done, timeout_s)

    @staticmethod
    def growth(before: dict[str, dict], after: dict[str, dict]) -> dict[str, Counter]:
        """Per engine, how much each counter rose."""
        return {role: counter_growth(before[role], after[role]) for role in ROLES}

    def loads(self) -> dict[str, dict]:
        return {role: self.engine_call(role, "load") for role in ROLES}

    def wait_until_nothing_scheduled(self, timeout_s: float) -> dict[str, dict]:
        """Both engines with no request running or waiting (KV blocks may still be held for a transfer)."""
        def unscheduled(loads):
            return all(l["running"] == l["waiting"] == 0 for l in loads.values())
        return wait_until(self.loads, unscheduled, timeout_s)

    def wait_until_idle(self, timeout_s: float) -> dict[str, dict]:
        """Both engines with no request and no KV block in use (or the last reading, once the time is up)."""
        def idle(loads):
            return all(l["running"] == l["waiting"] == 0 and l["kv_cache_usage"] == 0 for l in loads.values())
        return wait_until(self.loads, idle, timeout_s)


def counter_growth(before: dict, after: dict) -> Counter:
    """How much each counter of one engine rose: prompt tokens by source and transfer counters alike."""
    def flat(totals: dict) -> Counter:
        return Counter({**totals["prompt_tokens_by_source"], **totals["kv_transfers"]})
    return flat(after) - flat(before)


def wait_until(read: Callable[[], Any], done: Callable[[Any], bool], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def readme_example(name: str, language: str = "python") -> str:
    """The code block that follows `<!-- example: name -->` in README.md: the tests run README's examples."""
    found = re.search(rf"<!-- example: {name} -->\n```{language}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert found, f"README.md has no {language} example {name!r}"
    return found.group(1)


def app_config(**transfer) -> dict:
    """The CPU default config with the tests' short lifetimes, and any other transfer settings given. A request
    without a mode is pull here, as the suite's requests were written; the mode policy (`default_mode: auto`, the
    preset's) has tests of its own (test_mode_choice.py)."""
    config = yaml.safe_load(CPU_CONFIG.read_text())
    config["transfer"].update({"lease_s": LEASE_S, "push_timeout_s": PUSH_TIMEOUT_S, "default_mode": "pull",
                               **transfer})
    return config


def deploy_ingress(app: RunningApp, name: str, ingress: dict | None = None, decode: Any = None,
                   env_vars: dict[str, str] | None = None, transfer: dict | None = None) -> str:
    """Another ingress, as its own Serve application at /<name>, in front of the session's engines (or of `decode`,
    a bound stand-in deployment); `ingress` holds its config section, `transfer` any transfer settings. Returns its
    URL; `serve.delete(name)` ends it."""
    from ray import serve

    from app.config import PDAppConfig
    from app.ingress.server import OpenAIIngress

    config = app_config(**(transfer or {}))
    config["ingress"] = ingress or {}
    actor_options = {"num_cpus": 0, "runtime_env": {"env_vars": env_vars or {}}}
    bound = OpenAIIngress.options(name=f"Ingress-{name}", ray_actor_options=actor_options).bind(
        app.handles["prefill"], decode or app.handles["decode"], PDAppConfig.model_validate(config))
    serve.run(bound, name=name, route_prefix=f"/{name}")
    return f"{app.base_url}/{name}"


@contextlib.contextmanager
def own_app(app: RunningApp, config: dict, name: str) -> Iterator[str]:
    """The app from `config`, with engines of its own, as the Serve application at /<name> until the block ends;
    yields its URL once /health says both legs can take requests."""
    from ray import serve

    from app.builder import build_app

    # serve.run would wait for RUNNING without a bound; its internal _run deploys without waiting (Ray 2.60)
    serve._run(build_app(config), name=name, route_prefix=f"/{name}", _blocking=False)
    url = f"{app.base_url}/{name}"
    try:
        # Bounded, and deleted whatever happens: an application that never runs would otherwise hold its resources
        # and starve every module after this one.
        status = wait_until(lambda: serve.status().applications.get(name),
                            lambda s: s and s.status in ("RUNNING", "DEPLOY_FAILED"), timeout_s=OWN_APP_START_S)
        assert status and status.status == "RUNNING", f"{name} did not start within {OWN_APP_START_S} s: {status}"
        assert wait_until(lambda: httpx.get(url + "/health", timeout=10).status_code, lambda code: code == 200,
                          timeout_s=60) == 200
        yield url
    finally:
        serve.delete(name)


@pytest.fixture(scope="session")
def app(reference_outputs) -> RunningApp:
    """The app from the CPU default config on a Ray cluster this session starts and stops."""
    import ray
    from ray import serve

    from app.builder import build_app
    from kv.engine_identity import free_port

    port, metrics_port, dashboard_port = (free_port("127.0.0.1") for _ in range(3))
    # Two cores, and logical CPUs for the engines some modules start beside the app's (they share those cores): the
    # recompute test's decode engine, then test_replicas' four.
    # Metrics are exported each second rather than every ten, so that a test sees them soon after requests.
    # A cluster of its own ("local"), never one a killed run left its address behind for.
    ray.init(address="local", num_cpus=6, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=dashboard_port, logging_level="WARNING", _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_config()), name=APP_NAME, route_prefix="/")
        handles = {role: serve.get_deployment_handle(f"{role.capitalize()}Server", app_name=APP_NAME)
                   for role in ROLES}
        yield RunningApp(f"http://127.0.0.1:{port}", handles, f"http://127.0.0.1:{metrics_port}/metrics",
                         f"http://127.0.0.1:{dashboard_port}")
    finally:
        serve.shutdown()
        ray.shutdown()
