"""What every benchmark's report shares: the machine it ran on, and its place in README."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import psutil

from bench.systems import ROOT


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"


def update_readme(markdown_text: str, out: Path, start_marker: str, end_marker: str) -> None:
    """Put a report between its two markers in README.md, its images linked from where they were written."""
    readme = ROOT / "README.md"
    text = readme.read_text()
    start, end = text.index(start_marker) + len(start_marker), text.index(end_marker)
    relative = out.resolve().relative_to(ROOT)
    body = re.sub(r"\]\(([\w.-]+\.png)\)", lambda m: f"]({relative}/{m.group(1)})", markdown_text)
    readme.write_text(text[:start] + "\n" + body + text[end:])
