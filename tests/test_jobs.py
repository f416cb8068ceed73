"""Ray job submission against the running app: README's batch job example run as written (only its /tmp paths
moved into the test's directory), and a batch with bad lines through Ray's job submission client."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from conftest import CASES, ROOT, readme_example

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"


def results_by_id(path) -> dict[str, dict]:
    return {r["custom_id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_readme_batch_job(app, tmp_path):
    script = readme_example("batch-job", "bash").replace("/tmp/", f"{tmp_path}/")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "RAY_ADDRESS": app.dashboard_url})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 of 2 requests succeeded" in done.stdout
    results = results_by_id(tmp_path / "results.jsonl")
    assert {r["mode"] for r in results.values()} == {"pull", "push"}
    for result in results.values():
        assert result["status"] == 200 and result["text"] and result["first_token_s"] <= result["total_s"]
        assert result["transferred_prompt_tokens"] == result["prompt_tokens"]  # the whole prompt crossed as KV


def test_a_batch_with_failing_requests_fails_the_job_and_keeps_the_rest(app, tmp_path, reference_outputs):
    from ray.job_submission import JobStatus, JobSubmissionClient

    lines = [json.dumps({"custom_id": case.name, "url": "/v1/completions", "kv_transfer_mode": mode,
                         "body": {"model": MODEL, "prompt": case.prompt, "max_tokens": case.max_tokens,
                                  "temperature": 0}})
             for case, mode in ((CASES[1], "push"), (CASES[2], "local"))]
    lines += [json.dumps({"custom_id": "bad", "body": {"model": "no-such-model", "prompt": "hi"}}), "not json"]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    client = JobSubmissionClient(app.dashboard_url)
    job = client.submit_job(
        entrypoint=f"python -m app.batch --input {tmp_path}/in.jsonl --output {tmp_path}/out.jsonl --concurrency 2",
        runtime_env={"working_dir": str(ROOT)})
    deadline = time.monotonic() + 300
    while not (status := client.get_job_status(job)).is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
    logs = client.get_job_logs(job)
    assert status == JobStatus.FAILED, logs[-3000:]
    assert "2 of 4 requests succeeded" in logs
    results = results_by_id(tmp_path / "out.jsonl")
    assert results["bad"]["status"] == 404 and results["4"]["status"] == 400  # line 4 is not JSON
    for case in (CASES[1], CASES[2]):
        assert results[case.name]["text"] == reference_outputs[case.name]["text"]
    assert results[CASES[1].name]["transferred_prompt_tokens"] == results[CASES[1].name]["prompt_tokens"]
    assert results[CASES[2].name]["transferred_prompt_tokens"] == 0  # local: decode computed the prompt
