"""README's first command, `make serve` (`serve run serve_config.yaml`), run as written on a Ray of its own and from
an environment without the venv on PATH, as in a fresh terminal: the app comes up on 127.0.0.1:8000, serves a push
and a pull request whose prompts arrive on decode as KV, runs README's batch job (submitted as README says, from the
activated venv), and Ctrl-C ends it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import CASES, ROOT, readme_example

pytestmark = pytest.mark.engines

URL = "http://127.0.0.1:8000"  # serve_config.yaml's http_options
START_TIMEOUT_S = 420
JOB_AGENT_WAIT_S = 90


def wait_until_serving(process: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"make serve ended with status {process.returncode}:\n{log.read_text()[-3000:]}"
        try:
            # /health, not /v1/models: the ingress answers before Serve lists both engines as running
            if httpx.get(f"{URL}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(2)
    raise AssertionError(f"the app did not answer on {URL} within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def fresh_terminal_env() -> dict[str, str]:
    """This environment as a new terminal would have it: no venv on PATH, no Ray address, no Ray auth mode (the
    session's `ray.init` sets one in this process)."""
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "RAY_ADDRESS") and not k.startswith("RAY_AUTH")}
    return {**env, "PATH": path}


def ctrl_c_works():
    """A shell that runs the suite in the background ignores SIGINT, and its children inherit that; a terminal's
    `make serve` does not."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_readme_batch_job(tmp_path) -> None:
    script = readme_example("batch-job", "bash").replace("/tmp/", f"{tmp_path}/")
    # Right after the app serves, the head's job agent may not have registered yet; Ray then answers "No available
    # agent to submit job, please try again later", and a user would do just that (README says so).
    deadline = time.monotonic() + JOB_AGENT_WAIT_S
    while True:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env=fresh_terminal_env())
        if done.returncode == 0 or "No available agent" not in done.stderr or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 of 2 requests succeeded" in done.stdout
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in results} == {"pull", "push"}
    for result in results:
        assert result["status"] == 200 and result["text"] and result["first_token_s"] <= result["total_s"]
        assert result["transferred_prompt_tokens"] == result["prompt_tokens"]  # the whole prompt crossed as KV


def test_make_serve_runs_the_app_and_the_readme_job_and_ctrl_c_ends_it(tokenizer, tmp_path):
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", 8000)) != 0, "port 8000 is taken; make serve needs it"
    # RAY_ADDRESS=local: a Ray of its own, as on a machine with no cluster running (not the tests' cluster).
    env = {**fresh_terminal_env(), "RAY_ADDRESS": "local"}
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(["make", "serve"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=ctrl_c_works)
    try:
        wait_until_serving(process, log)
        prompt_tokens = len(tokenizer.encode(CASES[1].prompt))
        for mode in ("push", "pull"):
            response = httpx.post(f"{URL}/v1/completions", timeout=120, headers={"x-kv-transfer-mode": mode},
                                  json={"model": "tiny-qwen3", "prompt": CASES[1].prompt, "max_tokens": 4})
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            # decode computed none of the prompt: all of it crossed as KV
            assert usage["prompt_tokens_details"]["cached_tokens"] == prompt_tokens, (mode, usage)
        run_readme_batch_job(tmp_path)
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal reaches make and serve run alike
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", 8000)) != 0, "the app still answers after Ctrl-C"
