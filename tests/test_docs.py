"""The manual (docs/*.md, built by `bash .ci/docs`): the site builds strictly, its Python examples run as they
stand, the param reference is the param table's text, and every page or section an error message names exists."""
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
NOT_RUN = re.compile(r"<!-- not run: .+? -->\n+$")  # a block right after this comment is shown, not run


def read(path):
    with open(os.path.join(ROOT, path)) as handle:
        return handle.read()


def pages():
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(DOCS, "*.md")))


def headings(text):
    return {m.group(1).strip().replace("`", "") for m in re.finditer(r"^#{1,4} (.+)$", text, re.M)}


def python_blocks(text):
    """The page's ```python blocks in order, without those marked `<!-- not run: why -->`."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        if not NOT_RUN.search(text[:match.start()][-400:]):
            blocks.append(match.group(1))
    return blocks


def test_the_site_builds_strictly_with_the_param_table_and_the_api_reference(tmp_path):
    """mkdocs build --strict, as .ci/docs runs it: a broken link, anchor, include or reference fails here."""
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                             str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    built = {os.path.basename(p) for p in glob.glob(str(site / "*.html"))}
    assert {os.path.basename(p)[:-3] + ".html" for p in pages()} <= built
    from estimator.core.param_table import ESTIMATOR_PARAMS, MODEL_PARAMS

    params = (site / "params.html").read_text()
    for spec in ESTIMATOR_PARAMS + MODEL_PARAMS:  # every param, in a table row of the built page
        assert re.search(rf"<tr>\s*<td><code>{spec.name}</code></td>", params), spec.name
    api = (site / "api.html").read_text()
    for name in ("TorchEstimator", "TorchModel", "TrainContext", "StepContext", "Batch", "RankFailed", "Store"):
        assert f'id="{name}' in api or f">{name}<" in api, name
    started = (site / "getting-started.html").read_text()
    assert "--8&lt;--" not in started and "load_digits" in started  # the README's example, included


def test_the_param_hook_puts_the_param_table_under_its_markers():
    sys.path.insert(0, os.path.join(ROOT, ".ci"))
    try:
        import docs_hooks
    finally:
        sys.path.pop(0)
    from estimator.core.param_table import ESTIMATOR_PARAMS
    from estimator.core.params import markdown_table

    page = docs_hooks.render(read("docs/params.md"))
    assert markdown_table(ESTIMATOR_PARAMS) in page
    for spec in ESTIMATOR_PARAMS:
        assert f"| `{spec.name}` |" in page and spec.doc.replace("|", "\\|") in page
    assert "| `num_proc` |" not in read("docs/params.md")  # the page itself repeats nothing of the table


def cited(pattern):
    for path in glob.glob(os.path.join(ROOT, "estimator", "**", "*.py"), recursive=True) + \
            glob.glob(os.path.join(ROOT, "store", "*.py")):
        text = re.sub(r'"\s*\n\s*"', "", read(path))  # adjacent string literals joined, as Python joins them
        for match in re.finditer(pattern, text):
            yield os.path.relpath(path, ROOT), match.groups()


def test_every_page_and_section_an_error_names_exists():
    found = list(cited(r"(docs/[a-z-]+\.md) '([^']+)'"))
    assert len(found) >= 8
    for source, (page, section) in found:
        assert os.path.exists(os.path.join(ROOT, page)), f"{source} names {page}, which does not exist"
        assert section in headings(read(page)), f"{source} names {page} '{section}', not a heading there"
    readme = headings(read("README.md"))
    for source, (section,) in cited(r"README '([^']+)'"):
        assert section in readme, f"{source} names README '{section}', not a heading of README.md"


@pytest.mark.parametrize("page", pages())
def test_no_issue_numbers_and_every_session_is_stopped(page):
    """A Connect session not stopped hangs the interpreter at exit: a page that makes a session stops it last."""
    text = read(page)
    assert not re.search(r"\bissues? #?\d+", text, re.I)
    code = "\n".join(python_blocks(text))
    if "getOrCreate()" in code:
        assert code.rstrip().splitlines()[-1].startswith("spark.stop()"), page


@pytest.mark.spark
@pytest.mark.parametrize("page", [p for p in pages() if python_blocks(read(p))])
def test_the_python_blocks_of_each_page_run_in_order(page, tmp_path):
    """A page's examples run one after the other in one fresh process, as a reader runs them in a notebook."""
    code = "\n".join(python_blocks(read(page))).replace('"/tmp/', f'"{tmp_path}/')
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                            cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    if page == "docs/training.md":  # fits of digits: the built-in loop, recipes, train_step, train_fn, Lightning
        rows = [eval(line) for line in result.stdout.splitlines() if line.startswith("{'epoch'")]  # noqa: S307
        assert len(rows) == 5 and all(row["epoch"] == 4 for row in rows), result.stdout
        assert [row.get("val_accuracy", 1.0) >= 0.85 for row in rows] == [True] * 5, rows
        assert {"ce", "val_ce"} <= set(rows[2]), rows[2]
    if page == "docs/connect.md":
        assert "prediction" in result.stdout
