"""Greedy outputs of one colocated vLLM engine (no disaggregation, no KV connector): the reference the app must match.

`colocated_outputs` runs this file as a script in a process of its own, so that its engine is gone before the app's
engines start (the tests' session and `bench.chaos` compute their references this way).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def colocated_outputs(config_path: Path, prompts: list[dict], timeout_s: float = 600) -> list[dict]:
    """For each {"prompt_token_ids": [...], "max_tokens": N, optionally "logprobs": K and "json_schema": S}:
    {"text", "token_ids"} of a greedy completion by one engine of `config_path`'s decode side, held to the schema
    S by vLLM's structured outputs; with K, "logprobs": per token, the top K and the sampled token's logprobs by
    token id."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "outputs.json"
        done = subprocess.run([sys.executable, __file__, str(config_path), str(out)], input=json.dumps(prompts),
                              capture_output=True, text=True, cwd=ROOT, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"the colocated reference engine failed:\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from app.config import load_config
    from app.tiny_model import resolve_model_source

    engine = load_config(sys.argv[1]).decode
    os.environ.update(engine.runtime_env.get("env_vars", {}))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine.cpu_cores[0] if engine.cpu_cores else "auto"
    llm = LLM(model=resolve_model_source(engine.model_loading_config.model_source), **engine.engine_kwargs)
    prompts = json.load(sys.stdin)
    outputs = llm.generate(
        [{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts],
        [SamplingParams(temperature=0.0, max_tokens=p["max_tokens"], logprobs=p.get("logprobs"),
                        structured_outputs=StructuredOutputsParams(json=p["json_schema"])
                        if p.get("json_schema") else None) for p in prompts],
        use_tqdm=False,
    )
    with open(sys.argv[2], "w") as f:  # not stdout: vLLM logs there
        json.dump([_answer(o.outputs[0]) for o in outputs], f)


def _answer(completion) -> dict:
    answer = {"text": completion.text, "token_ids": list(completion.token_ids)}
    if completion.logprobs is not None:
        answer["logprobs"] = [{token: logprob.logprob for token, logprob in step.items()}
                              for step in completion.logprobs]
    return answer


if __name__ == "__main__":
    main()
