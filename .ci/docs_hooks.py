"""MkDocs hook: the param reference is the param table's own text, written into docs/params.md at build time
(each param is declared once, in estimator/core/param_table.py; nothing in docs/ repeats it)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- params of {}: the param table's rows, inserted by .ci/docs_hooks.py -->"


def tables():
    sys.path.insert(0, ROOT)
    try:
        from estimator.core.param_table import ESTIMATOR_PARAMS, MODEL_PARAMS, TRAINING_PARAMS
        from estimator.core.params import markdown_table
    finally:
        sys.path.remove(ROOT)
    return {"TorchEstimator": markdown_table(ESTIMATOR_PARAMS),
            "TorchModel": markdown_table([s for s in MODEL_PARAMS if s not in TRAINING_PARAMS])}


def render(markdown: str) -> str:
    """The page with each marker followed by its table (pages without a marker are unchanged)."""
    for name, table in tables().items():
        marker = MARKER.format(name)
        if marker in markdown:
            markdown = markdown.replace(marker, marker + "\n\n" + table)
    return markdown


def on_page_markdown(markdown, page, config, files):
    return render(markdown)
