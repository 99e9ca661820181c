"""The report: summary tables (:mod:`.tables`: TSV tables of every stage, the console summary) and the
landing page a person reads first (:mod:`.page`: results/report/summary.html with the plots inline).

The public face: names load lazily from the module that owns them."""

from dflash_pipeline.core.faces import lazy_face

_OWNERS = {
    "probe_table": "tables",
    "prompts_table": "tables",
    "GENERATION_COLUMNS": "tables",
    "generation_table": "tables",
    "TOKEN_COUNTS": "tables",
    "tokens_table": "tables",
    "LABELS": "tables",
    "label": "tables",
    "read_tsv": "tables",
    "html_table": "tables",
    "SUMMARY_STYLE": "tables",
    "eval_summary_rows": "tables",
    "tau_pivot": "tables",
    "ENGINE_VERDICTS": "tables",
    "engine_summary_lines": "tables",
    "console_summary": "tables",
    "PAGE_STYLE": "page",
    "png_data_uri": "page",
    "figures_html": "page",
    "header_html": "page",
    "data_line": "page",
    "run_facts": "page",
    "plot_tau_per_set": "page",
    "plot_tau_by_length": "page",
    "data_length_histograms": "page",
    "plot_data_lengths": "page",
    "length_table_rows": "page",
    "summary_page": "page",
    "RUN_FIGURES": "page",
    "run_figures": "page",
}

__all__ = sorted(_OWNERS)

__getattr__, __dir__ = lazy_face(__name__, _OWNERS, globals)
