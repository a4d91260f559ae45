"""MkDocs hooks: the param reference is the param table's own text, written into docs/params.md at build time
(each param is declared once, in estimator/core/param_table.py, and rendered to docs/_generated/params.md by
`python -m estimator.core.param_reference`: the build imports neither the package nor torch); the changelog page
is CHANGELOG.md (its links to docs/<page>.md made the site's); the site's name carries the package's version;
the lines a page shows on GitHub only (`<!-- github-only -->` blocks) are taken out."""
import configparser
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- params of {}: the param table's rows, inserted by .ci/docs_hooks.py -->"
GENERATED = os.path.join("docs", "_generated", "params.md")  # estimator.core.param_reference.FILE


def tables():
    """The tables by class name, from the file `python -m estimator.core.param_reference` writes (the package is not
    imported: the docs build needs neither torch nor pyspark; tests/test_docs.py keeps the file in step)."""
    with open(os.path.join(ROOT, GENERATED)) as handle:
        text = handle.read()
    found = re.findall(r"^<!-- table of (\w+) -->\n(.*?)(?=^<!-- table of |\Z)", text, re.S | re.M)
    return {name: table.strip("\n") + "\n" for name, table in found}


def linked(text: str) -> str:
    """The param table's references, `docs/training.md 'Train on text columns'` (as help() and the errors print them),
    as links to the section (MkDocs' heading anchors: lower case, spaces as hyphens)."""
    def link(found: re.Match) -> str:
        page, section = found.group(1), found.group(2)
        anchor = re.sub(r"[^\w\s-]", "", section.lower()).strip().replace(" ", "-")
        return f"[{page}.md '{section}']({page}.md#{anchor})"

    return re.sub(r"docs/([a-z-]+)\.md '([^']+)'", link, text)


def render(markdown: str) -> str:
    """The page with each marker followed by its table (pages without a marker are unchanged)."""
    for name, table in tables().items():
        marker = MARKER.format(name)
        if marker in markdown:
            markdown = markdown.replace(marker, marker + "\n\n" + linked(table))
    return markdown


CHANGELOG_MARKER = "<!-- the changelog: CHANGELOG.md at the repository root, inserted by .ci/docs_hooks.py"


def changelog() -> str:
    with open(os.path.join(ROOT, "CHANGELOG.md")) as handle:
        text = handle.read()
    return re.sub(r"\]\(docs/([^)]+)\)", r"](\1)", text)  # docs/training.md on GitHub, training.md on the site


def version() -> str:
    parser = configparser.ConfigParser()
    parser.read(os.path.join(ROOT, "setup.cfg"))
    found = parser.get("metadata", "version", fallback="")
    if found.startswith("attr:"):  # attr: estimator.__version__, read without importing the package
        module, name = found[5:].strip().rsplit(".", 1)
        with open(os.path.join(ROOT, *module.split("."), "__init__.py")) as handle:
            found = re.search(rf"^{name}\s*=\s*[\"']([^\"']+)", handle.read(), re.M).group(1)
    return found


def on_config(config):
    config.site_name = f"{config.site_name} {version()}".strip()
    return config


GITHUB_ONLY = re.compile(r"<!-- github-only -->.*?<!-- /github-only -->\n?", re.S)


def without_github_only(markdown: str) -> str:
    """The page without its `<!-- github-only -->` ... `<!-- /github-only -->` blocks, comments included: the
    lines that point a reader on GitHub past an include or a marker (their links leave docs/, which would fail the
    strict build; the site shows the included text itself). Only the page's own text: what a `--8<--` include
    brings in is added later, by the Markdown extension."""
    return GITHUB_ONLY.sub("", markdown)


def on_page_markdown(markdown, page, config, files):
    markdown = without_github_only(markdown)  # before anything else
    body = re.sub(r"\A---\n.*?\n---\n", "", markdown, flags=re.S)  # a page's front matter (MkDocs strips it)
    if body.lstrip().startswith(CHANGELOG_MARKER):
        return changelog()
    return render(markdown)
