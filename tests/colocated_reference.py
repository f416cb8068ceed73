"""Greedy outputs of one colocated vLLM engine (no disaggregation, no KV connector): the reference the app must match.

Run as a script in its own process so its engine is gone before the app's engines start:
    python tests/colocated_reference.py CONFIG_YAML OUTPUT_JSON < prompts.json
where prompts.json is a list of {"prompt_token_ids": [...], "max_tokens": N}.
"""

import json
import os
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    from app.config import load_config
    from app.tiny_model import resolve_model_source

    engine = load_config(sys.argv[1]).decode
    os.environ.update(engine.runtime_env.get("env_vars", {}))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine.cpu_cores[0] if engine.cpu_cores else "auto"
    llm = LLM(model=resolve_model_source(engine.model_loading_config.model_source), **engine.engine_kwargs)
    prompts = json.load(sys.stdin)
    outputs = llm.generate(
        [{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts],
        [SamplingParams(temperature=0.0, max_tokens=p["max_tokens"]) for p in prompts],
        use_tqdm=False,
    )
    with open(sys.argv[2], "w") as f:  # not stdout: vLLM logs there
        json.dump([{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)} for o in outputs], f)


if __name__ == "__main__":
    main()
