"""Prefill and decode on different Ray nodes (tests/multinode_probe.py, a cluster of two raylets on this machine):
each engine lands on the node its config names, its side channel listens on that node's address, and KV crosses
between the nodes in both modes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import CASES, ROOT

pytestmark = pytest.mark.engines


def test_prefill_and_decode_on_their_own_nodes(tokenizer):
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "multinode_probe.py"),
                           str(ROOT / "configs" / "cpu-two-nodes.yaml"), CASES[1].prompt],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    for role in ("prefill", "decode"):
        node = report[role]["node_id"]
        assert node == report["nodes"][role], report
        assert report[role]["side_channel_host"] == report["node_addresses"][node]
    prompt_tokens = len(tokenizer.encode(CASES[1].prompt))
    for mode in ("push", "pull"):
        assert report[mode]["status"] == 200, report[mode]
        # decode computed none of the prompt: its KV crossed from the other node
        assert report[mode]["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens, report[mode]
