"""Writes the generated pages of the documentation site and the README's generated tables.

`python -m dflash_pipeline.docs_gen` (from the repo root) rewrites `docs/reference/config.md` (from the
JSON Schema), `cli.md` (every entry point's argparse), `rules.md` (`rules/*.smk`), `families.md`
(`docs/results/zoo.json`) and the blocks between `<!-- BEGIN GENERATED name -->` and
`<!-- END GENERATED name -->` in the README and the tutorial. `--check` writes nothing and exits 1
listing the files that differ.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

from dflash_pipeline.docs_gen.cli import captured_parser, cli_reference, parser_markdown  # noqa: F401 (public API)
from dflash_pipeline.docs_gen.markdown import GENERATED_NOTE, REPO, md_table, md_text  # noqa: F401 (public API)

DEMO_RESULT = Path("docs/results/demo/acceptance.json")
ZOO_RESULT = Path("docs/results/zoo.json")
#: Hand-written files with generated blocks (`BEGIN GENERATED name` … `END GENERATED name`).
BLOCK_FILES = (
    "README.md",
    "docs/tutorial/demo.md",
    "docs/explanation/reproducibility.md",
    "docs/explanation/gpu-check.md",
)
#: `bench/bench_repro.py`'s record of the default demo on native and AVX2 kernels.
REPRO_RESULT = Path("docs/results/repro.json")
#: coverage.py's JSON report of the suite (only `meta` and `totals` are read; the per-file part may be dropped).
COVERAGE_RESULT = Path("docs/results/coverage.json")
#: `bench/gpu_check.sh --json` of the last run on a lent GPU.
GPU_CHECK_RESULT = Path("docs/results/gpu_check_h200.json")
COVERAGE_COMMAND = "python -m pytest -q -n 2 --cov=dflash_pipeline --cov-report=json:docs/results/coverage.json"


# --- Config reference (JSON Schema)


def _type_of(node: dict) -> str:
    if "const" in node:
        return json.dumps(node["const"])
    if "enum" in node:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    if "anyOf" in node or "oneOf" in node:
        return " or ".join(_type_of(n) for n in node.get("anyOf") or node["oneOf"])
    t = node.get("type")
    if isinstance(t, list):
        return " or ".join(t)
    if t == "array" and isinstance(node.get("items"), dict) and node["items"].get("type"):
        return f"array of {_type_of(node['items'])}"
    return t or "any"


def _bounds(node: dict) -> str:
    marks = []
    for key, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<")):
        if key in node:
            marks.append(f"{sign} {node[key]}")
    return f"({', '.join(marks)})" if marks else ""


def schema_keys(schema: dict, prefix: str = "") -> Iterator[tuple[str, dict]]:
    """Every key of the config schema as `(dotted path, schema node)`, depth first in schema order."""
    for name, node in (schema.get("properties") or {}).items():
        path = f"{prefix}{name}"
        yield path, node
        yield from _children(node, path)


def _children(node: dict, path: str) -> Iterator[tuple[str, dict]]:
    if node.get("properties"):
        yield from schema_keys(node, f"{path}.")
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and (extra.get("properties") or extra.get("additionalProperties")):
        yield f"{path}.<name>", extra
        yield from _children(extra, f"{path}.<name>")
    items = node.get("items")
    if isinstance(items, dict) and items.get("properties"):
        yield from schema_keys(items, f"{path}[].")


def load_config_schema() -> dict:
    """The config JSON Schema (`config/schema.yaml`) as a dict."""
    import yaml

    from dflash_pipeline.core.config import SCHEMA_PATH

    return yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))


def config_reference(schema: Optional[dict] = None) -> str:
    """`docs/reference/config.md`: one section per top-level key, one row per key (type, default,
    description)."""
    schema = schema or load_config_schema()
    out = [
        GENERATED_NOTE.format(source="config/schema.yaml"),
        "",
        "# Configuration keys",
        "",
        "Every key the workflow reads, from the JSON Schema `config/schema.yaml` that validates the config and fills "
        "the defaults (a key you leave out takes its default). Nested keys are dotted; `<name>` is a name you "
        "choose (a dataset, an eval set), `[]` an item of a list.",
        "",
    ]
    for top, node in (schema.get("properties") or {}).items():
        out += [f"## `{top}`", ""]
        if node.get("description"):
            out += [md_text(node["description"]).replace("\\|", "|"), ""]
        rows = []
        for path, sub in [(top, node), *_children(node, top)]:
            if path == top and node.get("properties"):
                continue  # the section itself: its keys follow
            default = json.dumps(sub["default"], ensure_ascii=False) if "default" in sub else "(required)"
            if "default" not in sub and path.endswith("<name>"):
                default = "—"
            rows.append(
                [
                    f"`{path}`",
                    " ".join(md_text(x) for x in (_type_of(sub), _bounds(sub)) if x),
                    f"`{default}`",
                    md_text(sub.get("description", "")),
                ]
            )
        out += [md_table(["key", "type", "default", "description"], rows), ""]
    return "\n".join(out)


# --- Rules reference (rules/*.smk)

#: Rule files in the order data flows through them (others follow, sorted).
RULE_FILE_ORDER = ("demo", "probe", "prompts", "completions", "tokens", "features", "train", "eval", "report")
_RULE = re.compile(r"^([ \t]*)(rule|checkpoint) (\w+):\s*$")


def rules_of(text: str) -> list[tuple[str, str, str]]:
    """`(kind, name, body)` of every rule of a Snakemake file, also rules defined inside an `if` block: the
    body is every line after `rule name:` indented deeper than it (blank lines included)."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = _RULE.match(line)
        if not m:
            continue
        indent = len(m.group(1).expandtabs())
        body = []
        for nxt in lines[i + 1 :]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            body.append(nxt)
        found.append((m.group(2), m.group(3), "\n".join(body) + "\n"))
    return found


def _rule_section(body: str, name: str) -> str:
    """The lines of one directive (`output:`) of a rule body, dedented; "" when absent."""
    lines = body.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == f"{name}:":
            indent = len(line) - len(line.lstrip())
            block = []
            for nxt in lines[i + 1 :]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                block.append(nxt)
            while block and not block[-1].strip():
                block.pop()
            pad = min((len(b) - len(b.lstrip()) for b in block if b.strip()), default=0)
            return "\n".join(b[pad:] for b in block)
    return ""


def _docstring(body: str) -> str:
    m = re.match(r'\s*"""(.*?)"""', body, re.S)
    return " ".join(m.group(1).split()) if m else ""


def rules_reference(repo: Path = REPO) -> str:
    """`docs/reference/rules.md`: per rule file, each rule's description and its `output:`."""
    out = [
        GENERATED_NOTE.format(source="rules/*.smk"),
        "",
        "# Rules and their outputs",
        "",
        "Every rule of the workflow, file by file (`Snakefile` includes them), with its description and its "
        "`output:` as the rule file writes it. Build one output with `snakemake --profile local <path>`; "
        "path helpers such as `report_table(...)` and `eval_dir(...)` are in `rules/common/paths.smk`.",
        "",
    ]
    files = [repo / "Snakefile", *(repo / "rules" / f"{s}.smk" for s in RULE_FILE_ORDER)]
    files += [p for p in sorted((repo / "rules").glob("*.smk")) if p not in files]
    for smk in files:
        if not smk.is_file():
            continue
        rules = rules_of(smk.read_text(encoding="utf-8"))
        if not rules:
            continue
        out += [f"## `{smk.relative_to(repo)}`", ""]
        for kind, name, body in rules:
            out += [f"### `{name}`" + (" (checkpoint)" if kind == "checkpoint" else ""), ""]
            doc = _docstring(body)
            if doc:
                out += [md_text(doc).replace("\\|", "|"), ""]
            output = _rule_section(body, "output")
            if output:
                out += ["```snakemake", output, "```", ""]
    return "\n".join(out)


# --- Supported families (docs/results/zoo.json)


def _zoo(repo: Path) -> Optional[dict]:
    path = repo / ZOO_RESULT
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _zoo_source_line(zoo: dict) -> str:
    src = zoo.get("source") or {}
    line = f"From `{src.get('command', '?')}` on {src.get('date', '?')} ({src.get('device', '?')})."
    if src.get("note"):
        line += " " + md_text(src["note"])
    return line


def families_reference(repo: Path = REPO) -> str:
    """`docs/reference/families.md`: the family × stage table of the zoo's last run."""
    out = [
        GENERATED_NOTE.format(source=str(ZOO_RESULT)),
        "",
        "# Supported target families",
        "",
        "Every family with a `config.json` in the model metadata corpus has a tiny random-weight twin built from "
        "its real config (`dflash_pipeline.testing.zoo`: the same config class, nesting, MLA/MoE routing, "
        "layer-type pattern and tied or untied head; sizes shrunk; a tokenizer that renders the family's real "
        "chat template), and so do a few architectures built from transformers' own config classes. "
        "`python -m dflash_pipeline.testing.zoo --table` runs every in-process stage on every twin "
        "(`--device auto` on a GPU box) and, with `--json docs/results/zoo.json`, writes the table this page "
        "is generated from. `tests/unit/testing/test_zoo.py` checks every twin in fp32 and bf16 on each test run.",
        "",
        "The engine-parity cell is the largest |Δ logit| between our draft and vLLM's own DFlash model on the "
        "fp32-trained export (tolerance 2e-4); see [engine parity](../explanation/engine-parity.md).",
        "",
    ]
    zoo = _zoo(repo)
    if zoo is None:
        return "\n".join(out + [f"No zoo table committed yet (`{ZOO_RESULT}`).", ""])
    out += [_zoo_source_line(zoo), ""]
    stages = zoo["stages"]
    for kind, title in (
        ("corpus", "Twins of the corpus' real configs"),
        ("transformers_config", "Twins from transformers' config classes"),
    ):
        fams = [f for f in zoo["families"] if f.get("kind", "corpus") == kind]
        if not fams:
            continue
        rows = [[md_text(f["family"]), *(md_text(f["cells"].get(s, "skipped")) for s in stages)] for f in fams]
        out += [f"## {title}", "", md_table(["family", *stages], rows), ""]
    return "\n".join(out)


def families_summary(repo: Path = REPO) -> str:
    """The README's families block: one line per family, all stages ok or where it stops."""
    zoo = _zoo(repo)
    if zoo is None:
        return f"No zoo table committed yet (`{ZOO_RESULT}`)."
    ok, stopped = [], []
    for f in zoo["families"]:
        cells = f["cells"]
        bad = next((s for s in zoo["stages"] if not str(cells.get(s, "")).startswith("ok")), None)
        if bad is None:
            ok.append(f["family"])
        else:
            reason = str(cells[bad]).split(":")[0]
            stopped.append(f"{f['family']} ({bad}: {reason})")
    src = zoo.get("source") or {}
    return (
        f"Every stage (build, probe, completions, tokens, training in fp32 and bf16, eval, engine parity) passes on "
        f"the tiny twins of: {', '.join(ok)}. Stopped with a reason: {', '.join(stopped) or 'none'}. "
        f"(The zoo's run of {src.get('date', '?')}; the table: [supported families](docs/reference/families.md).)"
    )


# --- The demo's τ table (docs/results/demo/acceptance.json)


def demo_tau_table(record: Optional[dict]) -> str:
    """The README's demo block: τ per drafter and eval set of an eval record (`acceptance.json`), with the
    settings it was measured under; a sentence saying how to produce it when there is none."""
    if record is None:
        return (
            f"No demo result is committed yet ({DEMO_RESULT}). After `snakemake --profile local`, copy "
            f"`results/eval/demo/acceptance.json` there and run `python -m dflash_pipeline.docs_gen`."
        )
    drafters = record["drafters"]
    sets = list(next(iter(drafters.values()))["sets"]) if drafters else []
    st = record.get("settings") or {}
    nums = {s: (record.get("sets") or {}).get(s, {}).get("num_prompts") for s in sets}
    cols = ["drafter", *(f"{s} ({nums[s]})" if nums[s] else s for s in sets)]
    rows = []
    for label, entry in drafters.items():
        steps = entry.get("train_steps")
        name = f"{label} ({steps} steps)" if steps else label
        rows.append([name, *(f"{entry['sets'][s]['tau']:.2f}" if s in entry["sets"] else "—" for s in sets)])
    settings = (
        f"τ (mean accepted drafts + 1 per verify step) at block size {st.get('block_size')}, temperature "
        f"{st.get('temperature')}, thinking `{st.get('thinking')}`, {st.get('max_new_tokens')} new tokens; "
        f"eval prompts per set in brackets. From `{DEMO_RESULT}`."
    )
    return md_table(cols, rows) + "\n\n" + settings


def repro_table(record: Optional[dict]) -> str:
    """The reproducibility block: τ of the default demo built on this machine's kernels and on AVX2 ones
    (`bench/bench_repro.py`'s `repro.json`), the relative difference per set, and where the stages part."""
    if record is None:
        return (
            f"No result is committed yet ({REPRO_RESULT}): run `python bench/bench_repro.py --work /tmp/repro`, "
            f"copy the `repro.json` it writes there and run `python -m dflash_pipeline.docs_gen`."
        )
    rows = [[r["set"], f"{r['native']:.3f}", f"{r['avx2']:.3f}", f"{r['diff_pct']:+.1f} %"] for r in record["tau"]]
    d = record["drift"]
    c, t = d["completions"], d["tokens"]
    worst = max(abs(r["diff_pct"]) for r in record["tau"])
    return (
        md_table(["eval set", f"τ, {d['cpu_capability'][0]} kernels", "τ, AVX2 kernels", "difference"], rows)
        + f"\n\nLargest difference {worst:.1f} %. Where the two builds part: the target is the same file "
        f"({'equal digests' if d['target_digest_equal'] else 'DIFFERENT digests'}); {c['equal']} of {c['records']} "
        f"completions have equal output ids; {t['equal']} of {t['records']} token records are equal; the final "
        f"training loss is {d['final_loss_a']:.4f} against {d['final_loss_b']:.4f}; the drafters' weights are "
        f"{'equal' if d['drafter_weights_equal'] else 'not equal'}. From `{REPRO_RESULT}`."
    )


def coverage_line(record: Optional[dict]) -> str:
    """The README's coverage line: the suite's line coverage of `src/dflash_pipeline` from coverage.py's JSON
    report (`totals`), with the command that writes it."""
    if record is None:
        return (
            f"No coverage result is committed yet: run `{COVERAGE_COMMAND}`, then `python -m dflash_pipeline.docs_gen`."
        )
    t = record["totals"]
    return (
        f"Line coverage of `src/dflash_pipeline`: {t['percent_covered']:.1f} % ({t['covered_lines']:,} of "
        f"{t['num_statements']:,} statements; `{COVERAGE_COMMAND}`, coverage.py {record['meta']['version']}, "
        f"{record['meta']['timestamp'][:10]})."
    )


def gpu_check_table(record: Optional[dict]) -> str:
    """The GPU check's table (`bench/gpu_check.sh --json`): one row per part, its status, seconds, time limit (a
    `limit s` column when the record has them) and figures."""
    if record is None:
        return f"No GPU run is committed yet ({GPU_CHECK_RESULT}): the script is ready for the first lent device."
    limits = any("limit_s" in r for r in record["rows"].values())
    rows = [
        [name, r["status"], f"{r['seconds']:.0f}"]
        + ([f"{r['limit_s']:.0f}" if "limit_s" in r else "-"] if limits else [])
        + [r["figures"].replace("|", "/")]
        for name, r in record["rows"].items()
    ]
    columns = ["check", "status", "s"] + (["limit s"] if limits else []) + ["figures"]
    return md_table(columns, rows) + f"\n\nOn {record['device']}, torch {record['torch']}. From `{GPU_CHECK_RESULT}`."


# --- Writing and checking

_BLOCK = re.compile(r"(<!-- BEGIN GENERATED (\S+)[^\n]*-->\n)(.*?)(<!-- END GENERATED \2 -->)", re.S)


def fill_blocks(text: str, blocks: dict[str, str]) -> str:
    """`text` with every `BEGIN GENERATED name` … `END GENERATED name` block's body replaced by
    `blocks[name]`.

    Raises:
        KeyError: a block names no known generator.
    """

    def sub(m):
        return m.group(1) + blocks[m.group(2)].rstrip("\n") + "\n" + m.group(4)

    return _BLOCK.sub(sub, text)


def readme_blocks(repo: Path = REPO) -> dict[str, str]:
    """The text of every generated block (name -> Markdown) of `BLOCK_FILES`."""
    demo = repo / DEMO_RESULT
    return {
        "demo-tau": demo_tau_table(json.loads(demo.read_text(encoding="utf-8")) if demo.is_file() else None),
        "families": families_summary(repo),
        "repro": repro_table(
            json.loads((repo / REPRO_RESULT).read_text()) if (repo / REPRO_RESULT).is_file() else None
        ),
        "gpu-check": gpu_check_table(
            json.loads((repo / GPU_CHECK_RESULT).read_text()) if (repo / GPU_CHECK_RESULT).is_file() else None
        ),
        "coverage": coverage_line(
            json.loads((repo / COVERAGE_RESULT).read_text()) if (repo / COVERAGE_RESULT).is_file() else None
        ),
    }


def generated_files(repo: Path = REPO) -> dict[Path, str]:
    """Every generated file's path (relative to `repo`) and the text it must hold."""
    pages = {
        Path("docs/reference/config.md"): config_reference(),
        Path("docs/reference/cli.md"): cli_reference(),
        Path("docs/reference/rules.md"): rules_reference(repo),
        Path("docs/reference/families.md"): families_reference(repo),
    }
    blocks = readme_blocks(repo)
    for name in BLOCK_FILES:
        pages[Path(name)] = fill_blocks((repo / name).read_text(encoding="utf-8"), blocks)
    return {p: t if t.endswith("\n") else t + "\n" for p, t in pages.items()}


def stale_files(repo: Path = REPO) -> list[Path]:
    """Generated files whose committed text differs from what the generators write now."""
    return [
        p
        for p, text in generated_files(repo).items()
        if not (repo / p).is_file() or (repo / p).read_text(encoding="utf-8") != text
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI (module docstring): write every generated file, or with `--check` exit with 1 when one differs."""
    ap = argparse.ArgumentParser(prog="python -m dflash_pipeline.docs_gen", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 listing the files that differ")
    ap.add_argument("--repo", default=str(REPO), help="repository root (default: this checkout)")
    a = ap.parse_args(argv)
    repo = Path(a.repo)
    if a.check:
        stale = stale_files(repo)
        for p in stale:
            print(f"stale: {p} (run python -m dflash_pipeline.docs_gen)", file=sys.stderr)
        return 1 if stale else 0
    from dflash_pipeline.core.shards import atomic_write_bytes

    for p, text in generated_files(repo).items():
        atomic_write_bytes(repo / p, text.encode("utf-8"))
        print(f"wrote {p}")
    return 0
