"""Deploy the applications of a Serve config file and return once they run, leaving them running: for Ray jobs,
where `serve run` would never exit.

    ray job submit --working-dir . -- python -m app.deploy serve_config.yaml

The applications keep the job's runtime environment (its uploaded working directory) after the job ends; Ray keeps
that package while a replica uses it. For long-lived production deployments prefer `serve deploy` with a
`working_dir` at a remote URI, which does not depend on a job's package.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import yaml


def build(import_path: str, args: dict):
    module, _, name = import_path.partition(":")
    return getattr(importlib.import_module(module), name)(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path, help="a Serve config file (serve_config.yaml)")
    args = parser.parse_args(argv)

    import ray
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(args.config.read_text()))
    ray.init(address="auto", logging_level="WARNING")  # the cluster the job was submitted to
    if runtime_envs := [app.name for app in config.applications if app.runtime_env]:
        parser.error(f"applications {runtime_envs} set a runtime_env: submit the job with it instead "
                     "(their code runs in the job's environment)")
    serve.start(proxy_location=config.proxy_location, http_options=config.http_options.model_dump(exclude_unset=True))
    for app in config.applications:
        serve.run(build(app.import_path, app.args), name=app.name, route_prefix=app.route_prefix, blocking=False)
        print(f"application {app.name!r} is running at route {app.route_prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
