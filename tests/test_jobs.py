"""Ray job submission against the running app, through Ray's job submission client: a batch with bad lines, and a
job that deploys the app and ends while the app runs on. (README's batch job, run as written against the cluster
`make serve` starts, is in test_make_serve.py.) The jobs name this venv's interpreter: the session's cluster runs
with the PATH pytest was started with."""

from __future__ import annotations

import json
import sys
import time

import httpx

import pytest
import yaml

from conftest import CASES, ROOT, readme_example

pytestmark = pytest.mark.engines
MODEL = "tiny-qwen3"


def results_by_id(path) -> dict[str, dict]:
    return {r["custom_id"]: r for r in map(json.loads, path.read_text().splitlines())}


def run_job(app, entrypoint: str):
    """Submits `entrypoint` with the project as working directory; its final status and logs."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(app.dashboard_url)
    job = client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(ROOT)})
    deadline = time.monotonic() + 300
    while not (status := client.get_job_status(job)).is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
    return status, client.get_job_logs(job)


def test_a_batch_with_failing_requests_fails_the_job_and_keeps_the_rest(app, tmp_path, reference_outputs):
    from ray.job_submission import JobStatus

    lines = [json.dumps({"custom_id": case.name, "url": "/v1/completions", "kv_transfer_mode": mode,
                         "body": {"model": MODEL, "prompt": case.prompt, "max_tokens": case.max_tokens,
                                  "temperature": 0, **extra}})
             for case, mode, extra in ((CASES[1], "push", {}), (CASES[2], "local", {"pd_class": "interactive"}))]
    lines += [json.dumps({"custom_id": "bad", "body": {"model": "no-such-model", "prompt": "hi"}}), "not json"]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    status, logs = run_job(
        app, f"{sys.executable} -m app.batch --input {tmp_path}/in.jsonl --output {tmp_path}/out.jsonl --concurrency 2")
    assert status == JobStatus.FAILED, logs[-3000:]
    assert "2 of 4 requests succeeded" in logs
    results = results_by_id(tmp_path / "out.jsonl")
    assert results["bad"]["status"] == 404 and results["4"]["status"] == 400  # line 4 is not JSON
    for case in (CASES[1], CASES[2]):
        assert results[case.name]["text"] == reference_outputs[case.name]["text"]
    assert results[CASES[1].name]["transferred_prompt_tokens"] == results[CASES[1].name]["prompt_tokens"]
    assert results[CASES[2].name]["transferred_prompt_tokens"] == 0  # local: decode computed the prompt
    # A batch job's requests are batch class unless their body names another.
    assert (results[CASES[1].name]["class"], results[CASES[2].name]["class"]) == ("batch", "interactive")


def test_a_job_deploys_the_app_and_ends_while_the_app_runs_on(app, tmp_path, tokenizer):
    """README's deploy job, with a config that names another application and route than the session's `pd`."""
    from ray import serve
    from ray.job_submission import JobStatus

    serve_config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    del serve_config["http_options"]  # the session's Serve already listens
    serve_config["applications"][0].update(name="pd-from-job", route_prefix="/pd-from-job")
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(serve_config))
    command = readme_example("deploy-job", "bash").strip().replace("serve_config.yaml", f"{tmp_path}/serve.yaml")
    try:
        status, logs = run_job(app, command.split(" -- ", 1)[1].replace("python", sys.executable, 1))
        assert status == JobStatus.SUCCEEDED, logs[-3000:]
        prompt = CASES[1].prompt
        response = httpx.post(f"{app.base_url}/pd-from-job/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                              headers={"x-kv-transfer-mode": "pull"})
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] == len(
            tokenizer.encode(prompt))
    finally:
        serve.delete("pd-from-job")
