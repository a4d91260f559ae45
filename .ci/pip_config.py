"""pip's configuration (its files and PIP_* variables, as `pip config list` shows them) as uv's options, one per
line: --index-url, --extra-index-url, --find-links and -c (constraint), each from the place pip itself would take
it (an environment variable over the install section over the global one); an index-url the install's own
arguments (given after the script's name) name is theirs, as pip's command line overrides its configured index
(the lists, extra indexes, find-links and constraints, add to its configuration's). Run by .ci/pip-install."""
import ast
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "-c"}
RANK = {":env:": 0, "install": 1, "global": 2}  # pip's precedence, first wins

listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
given = {"index-url"} if "--index-url" in sys.argv[1:] else set()
chosen = {}
for line in listed.splitlines():
    key, _, value = line.partition("=")
    section, _, name = key.rpartition(".")
    if name in FLAGS and name not in given and section in RANK and (name not in chosen or RANK[section] < chosen[name][0]):
        chosen[name] = (RANK[section], ast.literal_eval(value).split())
for name, (_, values) in chosen.items():
    for value in values:
        print(FLAGS[name])
        print(value)
