"""Session fixtures: the colocated reference outputs, then one real Ray cluster running the app with real engines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

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


@dataclass(frozen=True)
class Case:
    """One greedy request: either a completion prompt or a chat conversation."""

    name: str
    max_tokens: int
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


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
def reference_outputs(tokenizer, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Computed before the app starts, in a separate process, so the reference engine never shares cores."""
    prompts = [{"prompt_token_ids": prompt_token_ids(tokenizer, c), "max_tokens": c.max_tokens} for c in CASES]
    out = tmp_path_factory.mktemp("reference") / "outputs.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "colocated_reference.py"), str(CPU_CONFIG), str(out)],
        input=json.dumps(prompts), capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    outputs = json.loads(out.read_text())
    return {case.name: {**out, "prompt_token_ids": p["prompt_token_ids"]}
            for case, out, p in zip(CASES, outputs, prompts)}


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
    """The CPU default config with the tests' short lifetimes, and any other transfer settings given."""
    config = yaml.safe_load(CPU_CONFIG.read_text())
    config["transfer"].update(lease_s=LEASE_S, push_timeout_s=PUSH_TIMEOUT_S, **transfer)
    return config


def deploy_ingress(app: RunningApp, name: str, ingress: dict | None = None, decode: Any = None,
                   env_vars: dict[str, str] | None = None) -> str:
    """Another ingress, as its own Serve application at /<name>, in front of the session's engines (or of `decode`,
    a bound stand-in deployment); `ingress` holds its config section. Returns its URL; `serve.delete(name)` ends it."""
    from ray import serve

    from app.config import PDAppConfig
    from app.ingress import OpenAIIngress

    config = app_config()
    config["ingress"] = ingress or {}
    actor_options = {"num_cpus": 0, "runtime_env": {"env_vars": env_vars or {}}}
    bound = OpenAIIngress.options(name=f"Ingress-{name}", ray_actor_options=actor_options).bind(
        app.handles["prefill"], decode or app.handles["decode"], PDAppConfig.model_validate(config))
    serve.run(bound, name=name, route_prefix=f"/{name}")
    return f"{app.base_url}/{name}"


@pytest.fixture(scope="session")
def app(reference_outputs) -> RunningApp:
    """The app from the CPU default config on a Ray cluster this session starts and stops."""
    import ray
    from ray import serve

    from app.builder import build_app
    from kv.engine_identity import free_port

    port, metrics_port, dashboard_port = (free_port("127.0.0.1") for _ in range(3))
    # Jobs submitted to this cluster run `python` as a user's shell would find it: this venv's.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    # Two cores, and logical CPUs for the engines some modules start beside the app's (they share those cores): the
    # recompute test's decode engine, then test_replicas' four.
    # Metrics are exported each second rather than every ten, so that a test sees them soon after requests.
    ray.init(num_cpus=6, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dashboard_port,
             logging_level="WARNING", _metrics_export_port=metrics_port,
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
