"""The house's import rules (DESIGN.md), read from the code: every import statement, also those inside functions.

Modules: no import circle among those of estimator/ and store/; store/ imports nothing of estimator/; what runs
on the executors (a rank, from estimator.launch.rank_setup; transform's batches, from
estimator.predict.inference, and the output kinds unpickled there, estimator.predict.kinds) never imports
pyspark's driver API (pyspark.sql, pyspark.ml).
Folders, from the ground up: core -> data -> lm -> train -> launch -> predict -> fit (a folder imports only those
below it), with the user-facing modules at the top of estimator/ (at most 10); transform's side (predict/ and
model.py) imports nothing of fit/. A package's face (its __init__, which only hands names on) is no edge:
`import estimator` for its __file__ ties a module to no other.
Output kinds: their names (the keys of estimator.predict.kinds.PREDICTORS) are compared, or used as keys, only in
that package: elsewhere the kind's predictor is asked, never its name."""
import ast
import dataclasses
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("estimator", "store")
EXECUTOR_ENTRIES = ("estimator.launch.rank_setup", "estimator.predict.inference", "estimator.predict.kinds")
DRIVER_API = ("pyspark.sql", "pyspark.ml")
FLOORS = ("core", "data", "lm", "train", "launch", "predict", "fit")  # each folder imports only those before it
TRANSFORM_SIDE = ("estimator.model", "estimator.predict")  # TorchModel and what its transform runs
KINDS = "estimator.predict.kinds"  # the output kinds' package: their names are used there only


def _modules():
    found = {}
    for package in PACKAGES:
        for folder, dirs, names in os.walk(os.path.join(ROOT, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in names:
                if name.endswith(".py"):
                    dotted = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                    found[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = os.path.join(
                        folder, name)
    return found


MODULES = _modules()


def _imported(path):
    """Every module name an import statement of the file names (`from a import b`: a.b when that is a module)."""
    names = set()
    with open(path) as handle:
        tree = ast.parse(handle.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
            names |= subs | ({node.module} if len(subs) < len(node.names) else set())
    return names


IMPORTS = {m: _imported(p) for m, p in MODULES.items()}
EDGES = {m: {i for i in names if i in MODULES and i != m and i not in PACKAGES} for m, names in IMPORTS.items()}


def _circles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return circles


def _reached(start):
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo += EDGES[v]
    return seen


def test_the_rules_are_read_from_the_code():
    assert len(MODULES) > 50 and "estimator.data.streaming" in MODULES and "store.store" in MODULES
    assert "estimator.train.worker" in EDGES["estimator.launch.rank_setup"]  # from estimator.train.worker import ...
    assert "estimator.train.lightning" in EDGES["estimator.train.worker"]  # `from estimator import lightning`
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    assert _circles(EDGES) == []


def test_the_store_knows_nothing_of_the_estimator():
    assert {m: sorted(i for i in IMPORTS[m] if i.split(".")[0] == "estimator")
            for m in MODULES if m.startswith("store")} == {m: [] for m in MODULES if m.startswith("store")}


def test_what_runs_on_the_executors_never_imports_the_driver_api():
    for entry in EXECUTOR_ENTRIES:
        reached = _reached(entry)
        assert len(reached) > 3
        offending = {m: sorted(i for i in IMPORTS[m] if i.startswith(DRIVER_API)) for m in reached}
        assert {m: names for m, names in offending.items() if names} == {}, entry


def _folder(module):
    parts = module.split(".")
    return parts[1] if parts[0] == "estimator" and len(parts) > 2 else None


def test_each_folder_imports_only_the_folders_below_it():
    upward = sorted((m, i) for m, names in EDGES.items() for i in names
                    if _folder(m) in FLOORS and _folder(i) in FLOORS
                    and FLOORS.index(_folder(i)) > FLOORS.index(_folder(m)))
    assert upward == []
    assert {_folder(m) for m in MODULES} - {None} == set(FLOORS)  # a new folder takes its place in FLOORS


LM = "estimator.lm"  # what training and transform both do with a causal LM's tokens
LM_FUNCTIONS = ("generate_texts", "embeddings", "embed_texts", "answer_logps", "answer_sums", "row_index", "chunked_token_loss",
                "packed_attention")


def _defined(path):
    with open(path) as handle:
        return {n.name for n in ast.walk(ast.parse(handle.read())) if isinstance(n, ast.FunctionDef)}


def test_the_language_model_module_is_torch_and_transformers_and_the_only_home_of_its_functions():
    """estimator/lm stands below train/ and predict/ (FLOORS): both import it. It imports the standard library,
    numpy, torch and transformers only, besides the folders below it; generation, the answers' log-probabilities,
    the chunked loss and the packed attention are defined there and nowhere else."""
    import sys

    modules = [m for m in MODULES if _in(m, LM)]
    assert len(modules) >= 5 and f"{LM}.generation" in modules
    outside = {m: sorted(i for i in IMPORTS[m] if i.split(".")[0] not in sys.stdlib_module_names
                         and i.split(".")[0] not in ("numpy", "torch", "transformers", "estimator"))
               for m in modules}
    assert {m: names for m, names in outside.items() if names} == {}
    homes = {name: sorted(m for m, path in MODULES.items() if name in _defined(path)) for name in LM_FUNCTIONS}
    assert {name: [m for m in found if not _in(m, LM)] for name, found in homes.items()} == {
        name: [] for name in LM_FUNCTIONS}
    assert all(homes.values()), homes


OBJECTIVES = "estimator.train.objectives"  # the built-in loop's objectives: one module each, and the registry


def _objective_classes(path):
    """The classes a file defines on BuiltIn (an objective's base) or on a class named ...Objective."""
    with open(path) as handle:
        tree = ast.parse(handle.read())
    return sorted(n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and any(
        (getattr(b, "id", None) or getattr(b, "attr", "")) in ("BuiltIn",)
        or (getattr(b, "id", None) or getattr(b, "attr", "")).endswith("Objective") for b in n.bases))


def test_every_objective_lives_in_the_objectives_folder():
    found = {m: _objective_classes(path) for m, path in MODULES.items()}
    homes = {m: names for m, names in found.items() if names}
    assert {"TokenObjective", "DPO", "Objective", "StepObjective", "LightningObjective"} <= {
        n for names in homes.values() for n in names}
    assert sorted(m for m in homes if not _in(m, OBJECTIVES)) == []


def test_transform_imports_nothing_of_training():
    """What transform runs (predict/, TorchModel) and what a rank runs (train/) share what both need through the
    folders below train/ (lm/, data/, core/): neither imports the other (train/ above predict/ is the floors')."""
    side = [m for m in MODULES if any(_in(m, s) for s in TRANSFORM_SIDE)]
    assert len(side) > 5
    assert sorted((m, i) for m in side for i in EDGES[m] if _in(i, "estimator.train")) == []


RECIPE = "estimator.core.recipe"  # how a model is built: the factory's base, the adapters, the seed
PRECISION = "estimator.train.precision"  # the precision param's objects


def _called(path, names):
    """The names among `names` the file calls (as a bare name or an attribute)."""
    with open(path) as handle:
        tree = ast.parse(handle.read())
    return {getattr(n.func, "id", None) or getattr(n.func, "attr", None) for n in ast.walk(tree)
            if isinstance(n, ast.Call)} & set(names)


def test_a_model_is_built_by_one_recipe():
    """The adapters are put on a base (with_adapters), a factory is built on the meta device (built_on_meta), a
    quantized base prepared for adapters or built without its quantization, and the seed is set for all
    (torch.manual_seed) in estimator.core.recipe only: the ranks, the executors, getModel(),
    load and the driver all build through ModelRecipe (generation and the loop seed their draws, not a build)."""
    calls = {m: _called(path, ("with_adapters", "built_on_meta", "manual_seed", "get_peft_model",
                               "prepare_model_for_kbit_training", "unquantized"))
             for m, path in MODULES.items()}
    assert calls[RECIPE] >= {"with_adapters", "built_on_meta", "manual_seed", "prepare_model_for_kbit_training",
                             "unquantized"}  # a quantized base (QLoRA) is a step of the recipe
    elsewhere = {m: sorted(found) for m, found in calls.items() if found and m != RECIPE}
    assert elsewhere == {"estimator.core.adapters": ["get_peft_model"], "estimator.lm.generation": ["manual_seed"],
                         "estimator.lm.continuous": ["manual_seed"],  # generation's sampling
                         "estimator.train.loop": ["manual_seed"]}  # the loop seeds each step's dropout
    users = {m for m in MODULES if RECIPE in IMPORTS[m]}
    assert {"estimator.core.spec", "estimator.core.handle", "estimator.fit.recipes", "estimator.predict.weights"} <= users


def test_the_row_formats_are_named_only_where_they_are_defined_and_read_from_the_schema():
    """A causal LM's rows are a format object (estimator.data.rows: Text, PromptResponse, Chat, Pairs) that the
    tokenization, the driver's checks and the balancing ask; only the module that defines them and the driver's
    readers of the schema name them (no branch on a format's kind elsewhere), and LMSpec holds no format's flags."""
    from estimator.core.spec import LMSpec
    formats = ("Text", "PromptResponse", "Chat", "Pairs", "RowFormat")
    homes = {m: sorted(set(formats) & _names(path)) for m, path in MODULES.items()}
    assert {m: names for m, names in homes.items() if names} == {
        "estimator.data.rows": sorted(formats), "estimator.fit.language": sorted(formats)}
    assert [f.name for f in dataclasses.fields(LMSpec)] == ["rows", "every_token", "packed"]


def test_the_precision_param_is_read_by_its_objects_only():
    """No module but the precision objects' compares the param to a value or builds a GradScaler or an autocast;
    the checks that refuse a value on the driver (fit/) and the FSDP strategy's refusals name it in their text."""
    def names_value(path):
        with open(path) as handle:
            tree = ast.parse(handle.read())
        values = {"bf16-mixed", "16-mixed"}
        return any(isinstance(n, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in values
                                                      for c in [n.left, *n.comparators]) for n in ast.walk(tree))

    assert sorted(m for m, path in MODULES.items() if _in(m, "estimator.train") and m != PRECISION
                  and (names_value(path) or _called(path, ("GradScaler", "autocast")) - {"autocast"})) == [
        "estimator.train.strategies.fsdp"]
    assert sorted(m for m, path in MODULES.items() if "GradScaler" in _called(path, ("GradScaler",))) == [PRECISION]


def _names(path):
    """Every identifier the file's code uses or defines (names, attributes, imports, classes, functions)."""
    with open(path) as handle:
        tree = ast.parse(handle.read())
    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(n.attr)
        elif isinstance(n, (ast.ClassDef, ast.FunctionDef)):
            found.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            found |= {a.asname or a.name for a in n.names}
    return found


def test_the_drivers_dry_run_of_a_language_model_is_its_objectives():
    """fit/dry_run asks the objective (BuiltIn.dry_run) before its own checks: it imports no language-model
    objective, and knows only the loss param's (classic)."""
    objectives = sorted(i for i in EDGES["estimator.fit.dry_run"] if _in(i, OBJECTIVES))
    assert objectives == [f"{OBJECTIVES}.classic"]


def test_dpo_is_named_only_in_its_module_the_registry_and_the_exports():
    """The fit asks the objective (check_fit, reference_table, rows) what DPO needs: no other module names
    DPO or its reference's settings."""
    dpo = ("DPO", "reference_for", "reference_key", "REFERENCES", "precompute")
    homes = {m: sorted(set(dpo) & _names(path)) for m, path in MODULES.items()}
    assert {m: names for m, names in homes.items() if names} == {
        "estimator": ["DPO"], f"{OBJECTIVES}.registry": ["DPO"],
        f"{OBJECTIVES}.preference": ["DPO", "REFERENCES", "precompute", "reference_for", "reference_key"],
        f"{OBJECTIVES}.reference": ["precompute", "reference_key"]}


def test_the_top_of_the_package_holds_at_most_ten_modules():
    top = sorted(m for m in MODULES if m.startswith("estimator.") and m.count(".") == 1
                 and not os.path.isdir(os.path.join(ROOT, *m.split("."))))
    assert len(top) <= 10, top


STRATEGY_PACKAGE = "estimator.train.strategies"
WRAPPERS = ("Solo", "Sharded", "DistributedDataParallel", "FSDPModule")  # what a strategy wraps a model in


def _mentions_strategy(node):
    """The expression reads a strategy (p["strategy"], spec.strategy, a variable named so), anywhere inside."""
    return any(isinstance(n, ast.Name) and "strategy" in n.id or isinstance(n, ast.Attribute) and "strategy" in n.attr
               or isinstance(n, ast.Constant) and n.value == "strategy" for n in ast.walk(node))


def _strategy_branches(path, names):
    """file:line of each comparison of a strategy with a strategy's name (==, !=, in a tuple/list/set of
    constants) and each isinstance test against a strategy's wrapper, in one file ('auto' names other things
    too: a reader's pool)."""
    with open(path) as handle:
        tree = ast.parse(handle.read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            constants = [c.value for o in operands for c in ([o] if isinstance(o, ast.Constant) else getattr(
                o, "elts", [])) if isinstance(c, ast.Constant)]
            if any(c in names for c in constants) and any(_mentions_strategy(o) for o in operands):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any((getattr(k, "id", None) or getattr(k, "attr", None)) in WRAPPERS for k in kinds):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    return found


def test_no_strategy_name_or_wrapper_is_branched_on_outside_the_strategies(tmp_path):
    """A strategy is a class (estimator.train.strategies): the rest of the code asks it, never compares the
    strategy param's value or tests which wrapper the model is in. Checked against a file that does both."""
    from estimator.train.strategies import STRATEGIES

    names = set(STRATEGIES)
    assert names >= {"ddp", "fsdp", "auto"}
    sample = os.path.join(ROOT, "tests", "helpers.py")
    assert _strategy_branches(sample, names) == []
    bad = tmp_path / "branches.py"
    bad.write_text("def f(p, m, spec):\n    if p['strategy'] in ('fsdp', 'auto'):\n        return isinstance(m, Sharded)\n"
                   "    if format_of(spec.strategy) == 'fsdp':\n        return 1\n    return p['pool'] == 'auto'\n")
    assert sorted(s.rsplit(":", 1)[1] for s in _strategy_branches(str(bad), names)) == ["2", "3", "4"]
    offending = [hit for module, path in MODULES.items()
                 if module.startswith("estimator.") and not module.startswith(STRATEGY_PACKAGE)
                 for hit in _strategy_branches(path, names)]
    assert offending == []

def _in(module, package):
    return module == package or module.startswith(package + ".")


def test_transform_imports_nothing_of_fit():
    """predict/ and TorchModel (model.py) stand below the driver's fit: what they share with it (a language model's
    param checks) lives in predict/ or below."""
    side = sorted(m for m in MODULES if any(_in(m, s) for s in TRANSFORM_SIDE))
    assert "estimator.model" in side and "estimator.predict.inference" in side and len(side) > 5
    offending = {m: sorted(i for i in IMPORTS[m] if _in(i, "estimator.fit")) for m in side}
    assert {m: names for m, names in offending.items() if names} == {}


def _constants(node):
    """The string constants a node is, or holds as a tuple, list or set of constants."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def _names_used_as_values(tree):
    """(line, string) for each string constant compared (==, !=, in, is, a match case), used as a dict's key, a
    subscript, or looked up with .get/.pop/.setdefault; docstrings and other text are no such use."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            found += [(node.lineno, c) for operand in (node.left, *node.comparators) for c in _constants(operand)]
        elif isinstance(node, ast.Dict):
            found += [(node.lineno, c) for key in node.keys if key is not None for c in _constants(key)]
        elif isinstance(node, ast.Subscript):
            found += [(node.lineno, c) for c in _constants(node.slice)]
        elif isinstance(node, ast.MatchValue):
            found += [(node.value.lineno, c) for c in _constants(node.value)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
              and node.func.attr in ("get", "pop", "setdefault")):
            found += [(node.lineno, c) for c in _constants(node.args[0])]
    return found


def test_the_rules_on_kind_names_are_read_from_the_code():
    tree = ast.parse('"""generate"""\nif kind == "generate" or k in ("a", "generate") or d["generate"]:\n'
                     '    x = {"generate": 1}.get("generate", f(kind="generate"))\n'
                     'match kind:\n    case "generate": pass')
    assert sorted(_names_used_as_values(tree)) == [(2, "a"), (2, "generate"), (2, "generate"), (2, "generate"),
                                                   (3, "generate"), (3, "generate"), (5, "generate")]


def test_output_kinds_are_compared_by_name_only_in_their_package():
    """Adding an output kind is one module in estimator/predict/kinds/ and a line in its registry: no module
    outside the package branches on a kind's name (TorchModel asks the registry once, then the predictor)."""
    from estimator.predict.kinds import PREDICTORS

    names = {kind for kind in PREDICTORS if isinstance(kind, str)}
    assert len(names) >= 2
    used = {}
    for module, path in MODULES.items():
        if _in(module, "estimator") and not _in(module, KINDS):
            with open(path) as handle:
                hits = [f"line {line}: {value!r}" for line, value in _names_used_as_values(ast.parse(handle.read()))
                        if value in names]
            if hits:
                used[module] = hits
    assert used == {}
