"""The design doc and README cite only files the repo has (a newcomer follows them to the code)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Paths the docs name that are outputs of a run or files of a target directory, not repo files.
NOT_REPO_FILES = re.compile(r"^(results/|resources/|config\.json$|\.venv|.*\{)")


def cited_paths(text: str) -> set[str]:
    """Backticked paths with a directory part or a reference doc (`reference/dflash.md`, `rules/x.smk`)."""
    found = set()
    for m in re.finditer(r"`([A-Za-z0-9_.{}*/-]+\.(?:py|smk|yaml|md|json|rst|sh))`", text):
        path = m.group(1)
        if "/" in path and not NOT_REPO_FILES.match(path):
            found.add(path)
    return found


def test_design_doc_and_readme_cite_existing_files():
    missing = []
    for doc in (REPO / "docs" / "DESIGN.md", REPO / "README.md"):
        for path in sorted(cited_paths(doc.read_text(encoding="utf-8"))):
            # relative to the repo, the doc, or the folder a table column names (docs/, rules/, tests/, the package)
            candidates = [
                base / path
                for base in (
                    REPO,
                    doc.parent,
                    REPO / "docs",
                    REPO / "rules",
                    REPO / "tests",
                    REPO / "src" / "dflash_pipeline",
                )
            ]
            if not any(c.exists() or (c.name.count("*") and list(c.parent.glob(c.name))) for c in candidates):
                missing.append(f"{doc.relative_to(REPO)}: {path}")
    assert not missing, missing


def test_readme_layout_names_every_module():
    """The README's Layout section names every module of the package (by its name in backticks, or a
    package folder such as `server/` that it describes as a whole): a module added without a row entry
    fails here, so the table keeps matching the tree."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    start = readme.index("\n## Layout")
    layout = readme[start : readme.index("\n## ", start + 5)]
    src = REPO / "src" / "dflash_pipeline"
    unnamed = []
    for py in sorted(src.rglob("*.py")):
        rel = py.relative_to(src)
        if py.name == "__init__.py":
            continue
        # a module of a sub-package (testing/server/app.py) may be covered by the sub-package's folder
        folders = [f"`{'/'.join(rel.parts[i:-1])}/`" for i in range(len(rel.parts) - 2)] if len(rel.parts) > 2 else []
        names = [f"`{py.stem}`", f"`{rel}`", f"`{py.name}`", *folders]
        if not any(n in layout for n in names):
            unnamed.append(str(rel))
    assert not unnamed, f"README Layout does not name: {unnamed}"
