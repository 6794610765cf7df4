"""The GPU check's packages on a machine without a registry (scripts/gpu_check.sh runs this first).

Installs, from the wheels scripts/gpu_wheels.sh fetched (.gpu_wheels/), those whose top-level
modules the running Python cannot import, with ``pip install --no-index --no-deps --target``
into one directory that gpu_check.sh then puts on PYTHONPATH: the image's own packages (its
torch above all) stay as they are. ``datasets`` cannot travel (pyarrow alone is 55 MB); where
the image has none, a module that raises on use stands in, because torchtitan imports it at
module level and nothing the check runs uses it (titan_spec reads Parquet records with it).
Prints one line per package and writes what it did to ``<target>/site.json``.

Usage: python scripts/gpu_site.py WHEELS_DIR TARGET_DIR
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

ABSENT = '''"""Stands in for the `datasets` package, which the GPU image lacks and cannot receive
(scripts/gpu_site.py): torchtitan imports names from it at module level. Any use raises."""


class _Absent:
    def __init__(self, *args, **kwargs):
        raise ModuleNotFoundError("datasets is not installed on this machine (scripts/gpu_site.py put this "
                                  "placeholder in its place); pip install datasets to use it")


def __getattr__(name):  # any name: a class that raises when called or instantiated
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Absent,), {})
'''

ABSENT_DISTRIBUTED = "from datasets import __getattr__  # noqa: F401  (datasets.distributed's names, the same way)\n"


def top_level(wheel: Path) -> list[str]:
    """The importable top-level names a wheel installs (its top_level.txt, else its RECORD's
    first path parts)."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        listed = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        if listed:
            tops = z.read(listed[0]).decode().split()
        else:
            tops = sorted(
                {
                    n.split("/")[0].removesuffix(".py")
                    for n in names
                    if not n.split("/")[0].endswith((".dist-info", ".data"))
                }
            )
    return [t for t in tops if t]


def main(wheels_dir: str, target: str) -> int:
    wheels, site = sorted(Path(wheels_dir).glob("*.whl")), Path(target)
    site.mkdir(parents=True, exist_ok=True)
    report = {"python": sys.version.split()[0], "installed": [], "present": [], "placeholders": []}
    missing = []
    for w in wheels:
        tops = top_level(w)
        have = all(importlib.util.find_spec(t) is not None for t in tops)
        (report["present"] if have else report["installed"]).append(w.name)
        if not have:
            missing.append(w)
        print(f"gpu_site: {'present ' if have else 'install '} {w.name} ({', '.join(tops)})", file=sys.stderr)
    if missing:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
            "--no-deps",
            "--target",
            str(site),
            *map(str, missing),
        ]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            print(
                f"gpu_site: pip install --target {site} failed: {p.stderr.strip().splitlines()[-1:]}", file=sys.stderr
            )
            return 1
    if importlib.util.find_spec("datasets") is None:
        pkg = site / "datasets"
        pkg.mkdir(exist_ok=True)
        (pkg / "__init__.py").write_text(ABSENT)
        (pkg / "distributed.py").write_text(ABSENT_DISTRIBUTED)
        report["placeholders"].append("datasets")
        print("gpu_site: placeholder datasets (the image has none; it raises on use)", file=sys.stderr)
    (site / "site.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python scripts/gpu_site.py WHEELS_DIR TARGET_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(*sys.argv[1:]))
