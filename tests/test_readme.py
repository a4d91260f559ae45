"""The README starts where a user starts, and leads into the manual (docs/, tested by test_docs.py)."""
import ast
import builtins
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme():
    with open(os.path.join(ROOT, "README.md")) as handle:
        return handle.read()


def test_the_readme_is_a_front_door_whose_links_exist():
    text = readme()
    assert len(text.splitlines()) <= 200  # the manual is docs/
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert "docs/training.md" in links and "CONTRIBUTING.md" in links
    for link in links:
        if not link.startswith("http"):
            assert os.path.exists(os.path.join(ROOT, link)), link


def test_the_first_screen_has_the_commands_alone_on_their_lines():
    text = readme()
    head = text[:text.index("\n## Install\n")]
    blocks = re.findall(r"```bash\n(.*?)```", head, re.S)
    assert blocks[:3] == ["bash .ci/setup && .venv/bin/python notebooks/digits_example.py\n",
                          "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash .ci/setup \\\n"
                          "  && .venv/bin/python notebooks/digits_example.py\n",
                          "bash .ci/test\n"]
    assert len(head.splitlines()) < 60
    with open(os.path.join(ROOT, ".ci", "run")) as handle:
        assert handle.read().strip().splitlines()[-1] == "bash .ci/test"  # CI runs exactly the README's command


def test_no_internal_issue_numbers():
    assert not re.search(r"\bissues? #?\d+", readme(), re.I)


def test_every_python_snippet_that_makes_a_session_stops_it():
    """A Connect session not stopped hangs the interpreter at exit: every example and snippet stops its own."""
    text = readme()
    snippets = re.findall(r"```python\n(.*?)```", text, re.S)
    for code in snippets:
        if "getOrCreate()" in code and "SparkSession" in code:
            assert "spark.stop()" in code, code
    for name in os.listdir(os.path.join(ROOT, "notebooks")):
        if name.endswith(".py"):
            with open(os.path.join(ROOT, "notebooks", name)) as handle:
                assert "spark.stop()" in handle.read(), name


def test_the_fine_tuning_snippet_defines_every_name_it_uses_and_bert_bases_learning_rate():
    """Pasted into a notebook that has a Spark session `spark`, it runs: every other name it uses is imported or
    assigned in it (its lines from `est = ...` on are notebooks/text_example.py's, run by test_example.py)."""
    block = re.search(r"^## Fine-tune a pretrained model\n.*?```python\n(.*?)^```", readme(), re.S | re.M).group(1)
    tree = ast.parse(block)
    defined = {"spark"} | set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert used <= defined, f"used, never defined: {sorted(used - defined)}"
    assert "AdamW, lr=lr" in block and re.search(r"^epochs, lr = 3, 2e-5 ", block, re.M)  # BERT-base's
