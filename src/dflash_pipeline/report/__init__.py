"""The report: summary tables (`.tables`: TSV tables of every stage, the console summary) and the
landing page a person reads first (`.page`: results/report/summary.html with the plots inline, drawn by `.plots`).

The public face: names load lazily from the module that owns them."""

from dflash_pipeline.core.faces import lazy_face

_OWNERS = {
    "tables": (
        "probe_table prompts_table GENERATION_COLUMNS generation_table TOKEN_COUNTS tokens_table LABELS label"
        " read_tsv html_table SUMMARY_STYLE eval_summary_rows tau_pivot ENGINE_VERDICTS engine_summary_lines"
        " console_summary"
    ),
    "page": (
        "PAGE_STYLE png_data_uri figures_html header_html data_line run_facts length_table_rows summary_page"
        " RUN_FIGURES run_figures"
    ),
    "plots": "plot_tau_per_set plot_tau_by_length data_length_histograms plot_data_lengths",
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _OWNERS, globals)
