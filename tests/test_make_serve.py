"""README's first command, `make serve` (`serve run serve_config.yaml`), run as written on a Ray of its own: the
app comes up on 127.0.0.1:8000, serves a push and a pull request whose prompts arrive on decode as KV, and Ctrl-C
ends it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import httpx
import pytest

from conftest import CASES, ROOT

pytestmark = pytest.mark.engines

URL = "http://127.0.0.1:8000"  # serve_config.yaml's http_options
START_TIMEOUT_S = 420


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


def test_make_serve_runs_the_app_and_ctrl_c_ends_it(tokenizer, tmp_path):
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", 8000)) != 0, "port 8000 is taken; make serve needs it"
    # RAY_ADDRESS=local: a Ray of its own, as on a machine with no cluster running (not the tests' cluster).
    env = {**os.environ, "RAY_ADDRESS": "local"}
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(["make", "serve"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
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
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal reaches make and serve run alike
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", 8000)) != 0, "the app still answers after Ctrl-C"
