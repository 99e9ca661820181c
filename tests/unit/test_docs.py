"""The README, the design doc and the documentation site's hand-written pages cite only files the repo has (a
newcomer follows them to the code), and the code layout page names every module."""

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


#: The hand-written pages (the reference/ briefs about peer systems cite the peers' files, not ours).
DOCS = (
    REPO / "README.md",
    REPO / "CHANGELOG.md",
    REPO / "docs" / "DESIGN.md",
    REPO / "docs" / "index.md",
    *sorted((REPO / "docs").glob("tutorial/*.md")),
    *sorted((REPO / "docs").glob("how-to/*.md")),
    *sorted((REPO / "docs").glob("explanation/*.md")),
    REPO / "docs" / "reference" / "outputs.md",
    REPO / "docs" / "reference" / "layout.md",
    REPO / "docs" / "reference" / "tests.md",
)


def test_docs_cite_existing_files():
    missing = []
    for doc in DOCS:
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


def test_layout_page_names_every_module():
    """The code layout page (docs/reference/layout.md) names every module of the package (by its name in
    backticks, or a package folder such as `server/` that it describes as a whole): a module added without a
    row entry fails here, so the table keeps matching the tree."""
    layout = (REPO / "docs" / "reference" / "layout.md").read_text(encoding="utf-8")
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
    assert not unnamed, f"docs/reference/layout.md does not name: {unnamed}"
