"""Prose per code character in ``src/dflash_pipeline``, against transformers' ``modeling_qwen3.py``.

Each file is read with Python's ``tokenize``. Prose is the non-whitespace characters of comments and of
docstrings (a string statement that is the first statement of a module, class or function); code is the
non-whitespace characters of every other token. The table gives prose / code per top-level subpackage
(modules directly in the package count as ``(top level)``) and in total, then the 10 modules with the most
prose per code character. The baseline, measured in the same run with the same rules, is
``models/qwen3/modeling_qwen3.py`` of the installed transformers (and any ``--anchor`` file).

    python bench/bench_prose.py
    python bench/bench_prose.py --anchor path/to/other_model.py
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "dflash_pipeline"
WHITESPACE_TOKENS = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def docstring_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) of each docstring as tokenize positions: (1-based line, character column)."""
    lines = source.splitlines(keepends=True)

    def char_col(lineno: int, byte_col: int) -> int:  # ast columns count UTF-8 bytes, tokenize's characters
        return len(lines[lineno - 1].encode("utf-8")[:byte_col].decode("utf-8"))

    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                start = (first.lineno, char_col(first.lineno, first.col_offset))
                spans.append((start, (first.end_lineno, char_col(first.end_lineno, first.end_col_offset))))
    return spans


def measure(path: Path) -> tuple[int, int]:
    """(prose characters, code characters) of one Python file, whitespace not counted."""
    source = path.read_text(encoding="utf-8")
    spans = docstring_spans(source)
    prose = code = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in WHITESPACE_TOKENS:
            continue
        n = sum(not c.isspace() for c in tok.string)
        if tok.type == tokenize.COMMENT or (
            tok.type == tokenize.STRING and any(s <= tok.start and tok.end <= e for s, e in spans)
        ):
            prose += n
        else:
            code += n
    return prose, code


def ratio(prose: int, code: int) -> float:
    return prose / code if code else 0.0


def qwen3_anchor() -> Path | None:
    """transformers' ``models/qwen3/modeling_qwen3.py`` in this interpreter's environment (not imported)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / "qwen3" / "modeling_qwen3.py"
    return path if path.is_file() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchor", type=Path, action="append", default=[], help="another file to measure as a baseline")
    ap.add_argument("--worst", type=int, default=10, help="how many modules to list by prose / code")
    ap.add_argument(
        "--smoke", action="store_true", help="the suite's smoke test: the same measurement (it takes seconds)"
    )
    args = ap.parse_args()

    per_module = {p.relative_to(PACKAGE): measure(p) for p in sorted(PACKAGE.rglob("*.py"))}
    packages: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for rel, (prose, code) in per_module.items():
        row = packages[rel.parts[0] if len(rel.parts) > 1 else "(top level)"]
        row[0] += 1
        row[1] += prose
        row[2] += code
    total_prose = sum(p for p, _ in per_module.values())
    total_code = sum(c for _, c in per_module.values())

    print("prose per code character in src/dflash_pipeline (comments + docstrings / other non-whitespace tokens):")
    print(f"  {'package':<14} {'files':>5} {'prose chars':>12} {'code chars':>12} {'prose/code':>10}")
    for name, (files, prose, code) in sorted(packages.items()):
        print(f"  {name:<14} {files:>5} {prose:>12,} {code:>12,} {ratio(prose, code):>10.2f}")
    print(
        f"  {'total':<14} {len(per_module):>5} {total_prose:>12,} {total_code:>12,} {ratio(total_prose, total_code):>10.2f}"
    )

    print(f"\n{args.worst} modules with the most prose per code character:")
    worst = sorted(per_module.items(), key=lambda kv: ratio(*kv[1]), reverse=True)[: args.worst]
    for rel, (prose, code) in worst:
        print(f"  {str(rel):<40} {prose:>8,} {code:>8,} {ratio(prose, code):>6.2f}")

    qwen3 = qwen3_anchor()
    anchors = ([("transformers models/qwen3/modeling_qwen3.py", qwen3)] if qwen3 else []) + [
        (str(a), a) for a in args.anchor
    ]
    if not anchors:
        sys.exit("no anchor: transformers is not installed here and no --anchor was given")
    print()
    for name, path in anchors:
        prose, code = measure(path)
        print(f"anchor {name}: prose {prose:,}, code {code:,}, prose/code {ratio(prose, code):.2f}")
    anchor_ratio = ratio(*measure(anchors[0][1]))
    print(f"ratio src / anchor: {ratio(total_prose, total_code) / anchor_ratio:.2f}x")


if __name__ == "__main__":
    main()
