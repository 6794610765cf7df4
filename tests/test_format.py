"""The tree is formatted by ruff and passes its small lint set (pyproject.toml [tool.ruff]),
so a diff never mixes a change with a reflow. Fix with `ruff format` and `ruff check`."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREES = ["titan_spec", "tests", "bench", "scripts"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--output-format", "concise", *TREES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_is_ruff_formatted():
    out = _ruff("format", "--check")
    unformatted = sorted({line.split(":", 1)[0] for line in out.stdout.splitlines() if "unformatted" in line})
    rc = out.returncode
    assert rc == 0 and not unformatted, (
        f"{len(unformatted)} file(s) not ruff-formatted (run `ruff format "
        f"{' '.join(TREES)}`): {', '.join(unformatted)}\n{out.stderr}"
    )


def test_the_tree_passes_ruff_check():
    out = _ruff("check")
    rc = out.returncode
    assert rc == 0, f"ruff check found:\n{out.stdout}{out.stderr}"
