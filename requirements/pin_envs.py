"""Pin every pip requirement of the per-rule conda envs (``envs/*.yaml``) to the lock's version.

``python requirements/pin_envs.py requirements/lock.txt envs/*.yaml`` (run by ``requirements/make-lock.sh``);
``--check`` only reports the entries that differ (exit 1), as ``tests/unit/test_envs.py`` does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_REQ = re.compile(r"^(\s*-\s+)([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*([<>=!~][^#]*)?(#.*)?$")


def normalize(name: str) -> str:
    """PEP 503 name: ``Foo_Bar.baz`` -> ``foo-bar-baz``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: str | Path) -> dict[str, str]:
    """``{normalized name: version}`` of a lock file's ``name==version`` lines.

    Raises:
        ValueError: a line that is not a comment, blank, or ``name==version`` (the file and line named).
    """
    out = {}
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if not m:
            raise ValueError(f"{path}:{n}: not a name==version pin: {line!r}")
        out[normalize(m.group(1))] = m.group(2)
    return out


def pin_env(text: str, lock: dict[str, str], *, env: str = "env") -> tuple[str, list[str]]:
    """``(text with every pip requirement of the env pinned ==, problems)``: a package the lock lacks is a problem
    (the lock must cover every env; add the package to an extra of pyproject.toml and regenerate)."""
    lines, problems, in_pip = [], [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("- pip:"):
            in_pip = True
        elif in_pip and not stripped.startswith("-") and stripped and not stripped.startswith("#"):
            in_pip = False
        m = _REQ.match(line) if in_pip and not stripped.startswith("- pip:") else None
        if m and not stripped.startswith("- -e"):
            name = normalize(m.group(2))
            if name not in lock:
                problems.append(f"{env}: {m.group(2)} is not in the lock")
            else:
                comment = f"  {m.group(5)}" if m.group(5) else ""
                line = f"{m.group(1)}{m.group(2)}{m.group(3) or ''}=={lock[name]}{comment}"
        lines.append(line)
    return "\n".join(lines) + "\n", problems


def main(argv: list[str]) -> int:
    check = "--check" in argv
    args = [a for a in argv if a != "--check"]
    lock = read_lock(args[0])
    bad = []
    for env in args[1:]:
        old = Path(env).read_text(encoding="utf-8")
        new, problems = pin_env(old, lock, env=env)
        bad += problems
        if new != old:
            if check:
                bad.append(f"{env}: pins differ from {args[0]}")
            else:
                Path(env).write_text(new, encoding="utf-8")
    for p in bad:
        print(p, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
