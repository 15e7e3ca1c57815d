"""Dependency floors of pyproject.toml, for .ci/floors.

    python .ci/floors.py constraints        pip constraints pinning every floor (name==floor)
    python .ci/floors.py check PYTHON       fail unless PYTHON's environment has every floor
    python .ci/floors.py newest PYTHON      fail if pip would upgrade a dependency of PYTHON's
                                            environment (the suite did not run on the newest)

Standard library only: it runs with the interpreter that creates the virtual environments.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# name[extras] >= version (the rest of the specifier, e.g. ",<3", is ignored)
_FLOOR = re.compile(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([^,;\s]+)")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floors() -> dict[str, str]:
    """The oldest admitted version of every dependency of the package, by normalised name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found: dict[str, str] = {}
    for requirement in project["dependencies"]:
        match = _FLOOR.match(requirement)
        if match is None:
            raise SystemExit(f"floors: {requirement!r} has no '>=' floor; give it one")
        found[_normal(match.group(1))] = match.group(3)
    return found


def _installed(python: str) -> dict[str, str]:
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format", "json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {_normal(p["name"]): p["version"] for p in json.loads(listed)}


def _same(installed: str, floor: str) -> bool:
    """``2.0`` is ``2.0.0``; ``0.55b0`` is itself."""

    def key(version: str) -> list[str]:
        parts = version.split(".")
        while len(parts) > 1 and parts[-1] == "0":
            parts.pop()
        return parts

    return key(installed) == key(floor)


def check(python: str) -> int:
    installed = _installed(python)
    wrong = []
    for name, floor in sorted(floors().items()):
        have = installed.get(name, "missing")
        print(f"  {name:<32} floor {floor:<10} installed {have}")
        if not _same(have, floor):
            wrong.append(name)
    if wrong:
        print(f"floors: not at their floor: {', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0


def newest(python: str) -> int:
    """Whether pip would upgrade any dependency in ``python``'s environment."""
    report = subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--dry-run",
            "--upgrade",
            "--upgrade-strategy",
            "eager",
            "--report",
            "-",
            "-e",
            f"{ROOT}[dev]",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    would = {
        _normal(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report)["install"]
        if not item.get("is_direct")
    }
    installed = _installed(python)
    stale = {name: version for name, version in would.items() if name in floors()}
    for name in sorted(floors()):
        print(f"  {name:<32} installed {installed.get(name, 'missing'):<10}")
    if stale:
        for name, version in sorted(stale.items()):
            print(f"floors: {name} {installed.get(name)} is not the newest ({version})", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["constraints"]:
        for name, floor in sorted(floors().items()):
            print(f"{name}=={floor}")
        return 0
    if len(argv) == 2 and argv[0] == "check":
        return check(argv[1])
    if len(argv) == 2 and argv[0] == "newest":
        return newest(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
