"""The manual (docs/*.md, built by `bash .ci/docs`): the site builds strictly, its Python examples run as they
stand, the param reference is the param table's text, and every page or section an error message names exists."""
import glob
import json
import html
import os
import re
import subprocess
import sys
import textwrap

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


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """The site, built once for the tests that read it: mkdocs build --strict, as .ci/docs runs it."""
    site = tmp_path_factory.mktemp("docs") / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                             str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return site


def test_the_site_builds_strictly_with_the_param_table_and_the_api_reference(built_site):
    """A broken link, anchor, include or reference fails the build (built_site)."""
    site = built_site
    built = {os.path.basename(p) for p in glob.glob(str(site / "*.html"))}
    assert {os.path.basename(p)[:-3] + ".html" for p in pages()} <= built
    from estimator.core.param_table import ESTIMATOR_PARAMS, MODEL_PARAMS

    params = (site / "params.html").read_text()
    for spec in ESTIMATOR_PARAMS:  # every param, in a table row of the built page, with an anchor to link to
        shown = spec.name.replace("_", "_<wbr>")
        assert re.search(rf'<tr>\s*<td><a id="estimator-{spec.name}"></a><code>{shown}</code></td>', params), \
            spec.name
    for spec in MODEL_PARAMS:
        shown = spec.name.replace("_", "_<wbr>")
        assert re.search(rf'<td><a id="(model|estimator)-{spec.name}"></a><code>{shown}</code></td>', params), \
            spec.name
    api = (site / "api.html").read_text()
    for name in ("TorchEstimator", "TorchModel", "TrainContext", "StepContext", "Batch", "RankFailed", "Store"):
        assert f'id="{name}' in api or f">{name}<" in api, name
    fields = (("estimator.train.steps.Batch", "features"), ("estimator.train.train_fn.TrainContext", "module"),
              ("estimator.failures.RankFailed", "summary"))
    for name, field in fields:  # Google-style docstrings: their fields as tables
        section = api[api.index(f'id="{name}"'):][:8000]
        assert re.search(rf'<tr class="doc-section-item">\s*<td><code><span title="{name}.{field}">', section), name
    for method in ("TorchEstimator.fit(df)", "TorchModel.transform(df)", "TorchModel.getHistory()",  # the table
                   "TorchModel.getBestEpoch()", "TorchModel.load(path)"):
        assert method in api, method
    for method in ("estimator.TorchEstimator.fit_on_parquet", "model.TorchModel.save_pretrained"):  # docstrings
        assert f'id="estimator.{method}"' in api, method
    import estimator

    changelog = (site / "changelog.html").read_text()  # CHANGELOG.md, its links the site's own
    assert "Unreleased" in changelog and 'href="language-models.html"' in changelog and 'href="docs/' not in changelog
    assert f"<title>spark-torch-estimator {estimator.__version__}" in (site / "index.html").read_text()
    search = json.loads((site / "search" / "search_index.json").read_text())
    assert "=" in search["config"]["separator"]  # strategy='fsdp' is found by fsdp
    boosted = {d["location"].split("#")[0] for d in search["docs"] if d.get("boost", 1) < 1}
    assert boosted == {"changelog.html", "benchmarks.html"}  # ranked below the pages that explain
    assert "Out of memory (OOM)" in (site / "troubleshooting.html").read_text()
    # the figures (benchmarks/figures.py draws them, from a real run for the history)
    for page, figure in (("index", "fit"), ("data", "shards"), ("failures", "retry")):  # drawn for a phone
        assert f'src="img/{figure}.svg"' in (site / f"{page}.html").read_text() and \
            (site / "img" / f"{figure}.svg").exists(), figure
    assert 'src="img/digits-history.svg"' in (site / "getting-started.html").read_text() and (site / "img" / "digits-history.svg").exists()
    started = (site / "getting-started.html").read_text()
    assert "--8&lt;--" not in started and "load_digits" in started  # the README's example, included
    for page in sorted(glob.glob(str(site / "*.html"))):  # the lines for readers on GitHub stay there
        text = open(page).read()  # (CONTRIBUTING's text may name the markers, escaped in code)
        assert "<!-- github-only" not in text and "On GitHub:" not in text, os.path.basename(page)
    wide = []  # also the API reference's docstring examples: no built code block scrolls sideways
    for page in sorted(glob.glob(str(site / "*.html"))):
        for block in re.findall(r"<pre\b.*?</pre>", open(page).read(), re.S):
            wide += [f"{os.path.basename(page)}: {len(line)}: {line.strip()[:60]}"
                     for line in html.unescape(re.sub(r"<[^>]+>", "", block)).splitlines() if len(line) > CODE_WIDTH]
    assert not wide, f"code lines wider than {CODE_WIDTH} columns on the built site:\n" + "\n".join(wide)


def test_no_table_or_code_block_needs_sideways_scrolling_on_a_desktop_nor_any_page_on_a_phone(built_site):
    """Every page of the built site, served over http, laid out by headless Chromium: at 1280 px (a desktop) no
    table and no code block is wider than its box (Material's content column is about 720 px there: a long
    unbreakable word in a table's cell widened one to 799 px once, its last column cut); at 390 px (a phone)
    boxes may scroll inside, but no page is wider than the screen."""
    from browser import boxes_cut

    names = sorted(os.path.basename(p) for p in glob.glob(str(built_site / "*.html")) if not p.endswith("404.html"))
    assert len(names) == len(pages())
    desktop = {page: cut for page, cut in boxes_cut(str(built_site), names, 1280).items() if cut}
    assert not desktop, "at 1280 px:\n" + "\n".join(f"{page}: {c}" for page, cut in desktop.items() for c in cut)
    phone = {page: [c for c in cut if c.startswith("the page")]
             for page, cut in boxes_cut(str(built_site), names, 390).items()}
    assert not any(phone.values()), "at 390 px:\n" + "\n".join(f"{p}: {c}" for p, cut in phone.items() for c in cut)


def test_a_site_published_under_a_path_has_a_sitemap_a_working_404_page_and_a_repository_link(tmp_path):
    """SITE_URL and REPO_URL (mkdocs.yml reads them when publishing): the sitemap lists every page, the 404 page's
    assets load under the site's path, and the header links to the repository."""
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "SITE_URL": "https://example.org/manual/",
           "REPO_URL": "https://github.com/example/spark-torch-estimator"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (site / "sitemap.xml").read_text().count("<loc>https://example.org/manual/") == len(pages())
    assert 'href="/manual/assets/stylesheets/' in (site / "404.html").read_text()
    assert 'href="https://github.com/example/spark-torch-estimator"' in (site / "index.html").read_text()


def test_the_docs_build_installs_the_docs_packages_only():
    """`bash .ci/docs` builds the site in a venv of the docs extra's packages: no torch, no pyspark (the param
    tables come from the generated file, the API reference from the source, read without importing it)."""
    result = subprocess.run(["bash", os.path.join(ROOT, ".ci", "docs")], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    python = os.path.join(ROOT, ".venv-docs", "bin", "python")
    for module in ("torch", "pyspark", "estimator"):
        found = subprocess.run([python, "-c", f"import {module}"], capture_output=True, cwd="/")
        assert found.returncode != 0, f"{module} is importable in .venv-docs"
    params = read("site/params.html")
    assert 'id="estimator-validation_steps_per_epoch"' in params and "Language models" in params
    assert 'id="estimator.estimator.TorchEstimator.fit"' in read("site/api.html")


def test_the_param_hook_puts_the_param_tables_under_their_markers_grouped_by_topic():
    """The tables the hook inserts are the param table's rows (the generated file in step with the code), the
    estimator's under a heading per topic, each of its params in exactly one topic."""
    hooks = docs_hooks()
    from estimator.core import param_reference
    from estimator.core.param_table import ESTIMATOR_PARAMS, TOPICS
    from estimator.core.params import breakable

    assert read(param_reference.FILE) == param_reference.render(), \
        f"{param_reference.FILE} is behind the param table: run python -m estimator.core.param_reference"
    named = [name for _, _, names in TOPICS for name in names]
    assert sorted(named) == sorted(spec.name for spec in ESTIMATOR_PARAMS), \
        (set(named) ^ {spec.name for spec in ESTIMATOR_PARAMS}, len(named) - len(set(named)))
    page = hooks.render(read("docs/params.md"))
    assert hooks.tables() == param_reference.tables()
    assert hooks.linked(param_reference.tables()["TorchEstimator"]) in page
    assert "[training.md 'Train on text columns'](training.md#train-on-text-columns)" in page  # a reference made a link
    assert [title for title, _, _ in TOPICS] == re.findall(r"^### (.+)$", page, re.M)[:len(TOPICS)]
    for spec in ESTIMATOR_PARAMS:
        shown = spec.name.replace("_", "_<wbr>")  # a long name may wrap after an underscore
        assert f'| <a id="estimator-{spec.name}"></a><code>{shown}</code> |' in page
        assert hooks.linked(breakable(spec.doc).replace("|", "\\|")) in page  # dotted names break at their dots
    assert "<code>num_proc</code> |" not in read("docs/params.md")  # the page itself repeats nothing of the table


def cited(pattern):
    for path in glob.glob(os.path.join(ROOT, "estimator", "**", "*.py"), recursive=True) + \
            glob.glob(os.path.join(ROOT, "store", "*.py")):
        text = re.sub(r'"\s*\n\s*"', "", read(path))  # adjacent string literals joined, as Python joins them
        for match in re.finditer(pattern, text):
            yield os.path.relpath(path, ROOT), match.groups()


def test_the_index_lists_every_page():
    index = read("docs/index.md")
    listed = set(re.findall(r"^\| \[[^\]]+\]\(([\w-]+\.md)\)", index, re.M))
    assert listed == {os.path.basename(p) for p in pages()} - {"index.md"}, \
        sorted(listed ^ ({os.path.basename(p) for p in pages()} - {"index.md"}))


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


CODE_WIDTH = 79  # what Material's code box shows at 1280 px: a wider line is cut (scrolls sideways)
FENCE = re.compile(r"^( *)(`{3,}|~{3,})")
INCLUDE = re.compile(r'^ *--8<-- "([^":]+)(?::([\w-]+))?" *$')  # pymdownx.snippets: a file, or its section
SECTION_MARK = re.compile(r"--8<-- \[(?:start|end):([\w-]+)\]")
LIST_ITEM = re.compile(r"^ *(?:[-*+]|\d+\.) ")
WIDE_ON_PURPOSE: set = set()  # lines a test pins whole and that cannot wrap (none today)


def site_lines(path, section=None):
    """(file, line number, line) of a page as the site renders it: its `--8<--` includes expanded in place."""
    numbered = list(enumerate(read(path).splitlines(), 1))
    if section is not None:  # the lines between the file's `--8<-- [start:section]` and `[end:section]`
        marks = [i for i, (_, line) in enumerate(numbered)
                 if (m := SECTION_MARK.search(line)) and m.group(1) == section]
        assert len(marks) == 2, f"{path} has no section {section}"
        numbered = numbered[marks[0] + 1:marks[1]]
        dedented = textwrap.dedent("\n".join(line for _, line in numbered)).split("\n")  # dedent_subsections
        numbered = [(number, line) for (number, _), line in zip(numbered, dedented)]
    for number, line in numbered:
        include = INCLUDE.match(line)
        if include:
            yield from site_lines(include.group(1), include.group(2))
        elif not SECTION_MARK.search(line):
            yield path, number, line


def markdown_files():
    return ["README.md"] + pages()


def layout_problems():
    """Each line of a code block wider than CODE_WIDTH, and each list glued to the text above it (Python-Markdown,
    which MkDocs uses, renders such a list as part of the paragraph; GitHub does not: markdownlint's MD032)."""
    wide, glued = {}, {}
    for page in markdown_files():
        fence, in_comment, previous, in_list = None, False, "", False
        for path, number, line in site_lines(page):
            where = f"{path}:{number}" + (f" (shown on {page})" if path != page else "")
            key = (path, number)
            if fence is not None:  # inside a code block: only its width counts
                closing = FENCE.match(line)
                if closing and closing.group(2)[0] == fence[1][0] and len(closing.group(2)) >= len(fence[1]) \
                        and not line[closing.end():].strip():
                    fence, previous, in_list = None, line, False
                    continue
                width = len(line) - min(len(fence[0]), len(line) - len(line.lstrip(" ")))
                if width > CODE_WIDTH and line.strip() not in WIDE_ON_PURPOSE:
                    wide.setdefault(key, f"{where}: {width} characters: {line.strip()[:60]}")
                continue
            opening = FENCE.match(line)
            if opening:
                fence, previous = opening.groups(), line
                continue
            if in_comment or line.lstrip().startswith("<!--"):  # HTML comments are not rendered
                in_comment = "-->" not in line
                continue
            if LIST_ITEM.match(line):  # (a table row, `| ... |`, is never an item: it ends a list as text does)
                continuation = in_list and previous.startswith(" ")
                if previous.strip() and not LIST_ITEM.match(previous) and not continuation:
                    glued.setdefault(key, f"{where}: {line.strip()[:60]!r} right under {previous.strip()[:60]!r}")
                in_list = True
            elif line.strip() and not line.startswith(" "):
                in_list = False
            previous = line
    return [wide[key] for key in sorted(wide)], [glued[key] for key in sorted(glued)]


def test_no_line_of_a_code_block_is_wider_than_79_columns():
    """At 1280 px Material's code box shows 79 columns: a wider line is cut (the copy button covers its end). Wrap
    Python as black does (arguments on continuation lines, strings split by implicit concatenation), bash with
    ` \\`, comments on their own line."""
    wide, _ = layout_problems()
    assert not wide, f"{len(wide)} code lines wider than {CODE_WIDTH} columns:\n" + "\n".join(wide)


def test_every_list_has_a_blank_line_above_it():
    """A list right under a paragraph renders as part of that paragraph on the site: put a blank line above it."""
    _, glued = layout_problems()
    assert not glued, f"{len(glued)} lists need a blank line above them:\n" + "\n".join(glued)


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
        stopped, best = map(int, re.search(r"^stopped after (\d+) best (\d+)$", result.stdout, re.M).groups())
        assert 1 <= best <= stopped < 30, result.stdout  # patience 2 of 30 epochs: it stops early
    if page == "docs/connect.md":
        assert "prediction" in result.stdout
    if page == "docs/tutorials.md":  # each tutorial's result, as a reader sees it
        accuracy = float(re.search(r"^test accuracy ([0-9.]+)$", result.stdout, re.M).group(1))
        assert accuracy >= 0.8, result.stdout
        assert re.search(r"\|What color is the kettle\?\s*\| The kettle is teal\.\s*\|", result.stdout), result.stdout
        assert "LlamaForCausalLM loads for serving" in result.stdout and "vectors of 64" in result.stdout


PARAGRAPH_WORDS = 80  # a longer paragraph is a wall of text on the site: split it, or lead into a list
LONG_ALLOWED, PARAGRAPH_MOST = 5, 150  # a few may run longer where a split would cut a thought in two
COMMENT = re.compile(r"^ *<!--")


def paragraphs(page):
    """(file, first line, text) of each prose paragraph of a page and of what it includes: fenced code, table rows,
    headings and HTML comments left out, each list item (sub-items too) a paragraph of its own."""
    found, current, fence, in_comment = [], None, None, False

    def close():
        nonlocal current
        if current:
            found.append((current[0], current[1], " ".join(current[2])))
        current = None

    for path, number, line in site_lines(page):
        if fence is not None:
            closing = FENCE.match(line)
            if closing and closing.group(2)[0] == fence[0] and len(closing.group(2)) >= len(fence) \
                    and not line[closing.end():].strip():
                fence = None
            continue
        opening = FENCE.match(line)
        if opening:
            close()
            fence = opening.group(2)
            continue
        if in_comment or COMMENT.match(line):
            close()
            in_comment = "-->" not in line
            continue
        stripped = line.strip()
        if re.match(r"(\?\?\?|!!!)\+? ", stripped):  # a note's title: its body's paragraphs are counted apart
            close()
            continue
        if not stripped or stripped.startswith("|") or re.match(r"#{1,6} ", line):
            close()
        elif LIST_ITEM.match(line) or current is None:
            close()
            current = (path, number, [stripped])
        else:
            current[2].append(stripped)
    close()
    return found


def test_paragraphs_are_short_enough_to_read_on_a_screen():
    """The manual's pages, the README and CONTRIBUTING.md, with what they include: at most LONG_ALLOWED paragraphs
    or list items over PARAGRAPH_WORDS words, none over PARAGRAPH_MOST."""
    long, seen = [], set()
    for page in markdown_files() + ["CONTRIBUTING.md"]:
        for path, number, text in paragraphs(page):
            words = len(text.split())
            if words > PARAGRAPH_WORDS and (path, number) not in seen:
                seen.add((path, number))
                long.append((words, f"{path}:{number}: {words} words: {' '.join(text.split()[:12])} ..."))
    too_long = [line for words, line in long if words > PARAGRAPH_MOST]
    assert len(long) <= LONG_ALLOWED and not too_long, \
        f"{len(long)} paragraphs over {PARAGRAPH_WORDS} words (at most {LONG_ALLOWED}; none over {PARAGRAPH_MOST}): " \
        "split them into several, or a lead sentence and a list:\n" + "\n".join(line for _, line in long)


GITHUB_ONLY = re.compile(r"^<!-- github-only -->\n(.*?)^<!-- /github-only -->$", re.S | re.M)
HOOK_MARKERS = ("<!-- params of ", "<!-- the changelog: ")


def docs_hooks():
    sys.path.insert(0, os.path.join(ROOT, ".ci"))
    try:
        import docs_hooks
    finally:
        sys.path.pop(0)
    return docs_hooks


def test_every_include_and_marker_has_a_line_for_readers_on_github():
    """On GitHub a page shows its `--8<--` includes, mkdocstrings' `:::` lines and the hook's markers as they are: a
    `<!-- github-only -->` block beside each says where the text is (a link to the included file), and the hook
    takes the blocks out of the site."""
    missing = []
    for page in pages():
        text = read(page)
        lines = text.splitlines()
        blocks = [(text[:m.start()].count("\n"), text[:m.end()].count("\n"), m.group(1))
                  for m in GITHUB_ONLY.finditer(text)]  # (first line, last line, text), 0-based
        for index, line in enumerate(lines):
            include = re.match(r' *--8<-- "([^":]+)', line)
            marker = line.startswith(HOOK_MARKERS)
            if not (include or marker or line.startswith("::: ")):
                continue
            near = [body for first, last, body in blocks if index - 5 <= last < index or index < first <= index + 4]
            if line.startswith("::: "):  # the API reference: one block above its first `:::` line
                near = [body for first, last, body in blocks if last < index]
            if not near:
                missing.append(f"{page}:{index + 1}: {line.strip()} has no github-only block beside it")
            elif include and not any(re.search(rf"\]\(\.\./{re.escape(include.group(1))}[)#]", body) for body in near):
                missing.append(f"{page}:{index + 1}: its github-only block does not link ../{include.group(1)}")
    assert not missing, "\n".join(missing)
    for body in [m.group(1) for p in pages() for m in GITHUB_ONLY.finditer(read(p))]:
        assert body.strip() and "--8<--" not in body, body  # a line GitHub shows; no snippet syntax in it
    hooks = docs_hooks()
    page = ("# Page\n\nText.\n\n<!-- github-only -->\n> On GitHub: [README](../README.md#install).\n"
            "<!-- /github-only -->\n\n--8<-- \"README.md:install\"\n\n<!-- github-only -->\nsecond\n"
            "<!-- /github-only -->\nMore text.\n")
    assert hooks.without_github_only(page) == "# Page\n\nText.\n\n\n--8<-- \"README.md:install\"\n\nMore text.\n"
    assert hooks.on_page_markdown(page, None, None, None) == hooks.without_github_only(page)
    changelog = read("docs/changelog.md")
    assert "github-only" in changelog and hooks.on_page_markdown(changelog, None, None, None) == hooks.changelog()
    for page in pages():  # every page as the site gets it: no block, no comment of one, no link out of docs/
        built = hooks.on_page_markdown(read(page), None, None, None)
        assert "github-only" not in built and "](../" not in built, page
