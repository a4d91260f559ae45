"""Turning the user's objects into bytes a worker can load, with errors that say the fix.

Classes defined in a notebook (`__main__`) are pickled by value by cloudpickle already. Classes from
a module that exists only on the driver (a .py file next to the notebook) would fail to import on
executors, so their modules are registered for pickling by value for the duration of the dump.
"""
from __future__ import annotations

import copy
import functools
import inspect
import os
import site
import sys
import sysconfig
import threading
from types import ModuleType
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Set

import torch
from torch import nn

from estimator.core.numbers import plain
from estimator.core.spec import UserObjects

# Our own packages are installed on executors wherever the estimator runs.
_INSTALLED_EVERYWHERE = {"estimator", "store", "torch", "numpy", "pyspark", "builtins"}


def user_objects(model: nn.Module, optimizer: Any, losses: List[Any], loss_weights: List[float], metrics: List[Any],
                 lr: Optional[float] = None, model_factory: Any = None, **chosen: Any) -> UserObjects:
    """A copy of everything the ranks need, built whole; the user's own model and optimizer are not touched. `lr`
    (the estimator's param) replaces the learning rate of every param group. No optimizer: a LightningModule's
    configure_optimizers builds one on every rank. `model_factory`: what built `model` (the ranks call it; the
    model is not pickled). An optimizer that is a callable is called with each rank's parameters. `chosen`: the
    other fields of UserObjects (the objective, the strategy, train_step, tokenizer...)."""
    kept = dict(model=model if model_factory is not None else copied(model, "model").cpu(),
                losses=copy.deepcopy(list(losses)), loss_weights=list(loss_weights), metrics=list(metrics),
                model_factory=model_factory, **chosen)
    if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
        return UserObjects(optimizer_cls=None, optimizer_groups=[], optimizer_defaults={}, optimizer_state={},
                           lightning=optimizer is None, optimizer_factory=optimizer, optimizer_lr=lr, **kept)
    groups = optimizer_groups(optimizer, model)
    # numpy hyperparameters (Adam(lr=np.float64(...))) as Python numbers: checkpoints load with weights_only=True
    defaults, state = plain(constructor_defaults(optimizer)), copy.deepcopy(optimizer.state_dict())
    state["param_groups"] = plain(state["param_groups"])
    if lr is not None:
        if "lr" in defaults:
            defaults["lr"] = lr
        for group in state["param_groups"]:
            group["lr"] = lr
    return UserObjects(optimizer_cls=type(optimizer), optimizer_groups=groups, optimizer_defaults=defaults,
                       optimizer_state=state, **kept)


def optimizer_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> List[List[int]]:
    """Per param group, the indices of its params in `list(model.parameters())`.

    The optimizer may hold this model's params, or those of another instance of the same
    architecture (`optim.SGD(Net().parameters())`): then params are matched by position and shape.
    """
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if all(id(p) in index for p in held):
        return [[index[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    if len(held) == len(params) and all(a.shape == b.shape for a, b in zip(held, params)):
        groups, start = [], 0
        for group in optimizer.param_groups:
            groups.append(list(range(start, start + len(group["params"]))))
            start += len(group["params"])
        return groups
    raise ValueError(
        "The 'optimizer' parameter of TorchEstimator must optimize the parameters of 'model' "
        f"(it holds {len(held)} tensors, the model has {len(params)} with other shapes). "
        "Build it as optim.SGD(model.parameters(), ...) over the model you pass.")


def rebuild_optimizer(cls: type, groups: List[List[int]], defaults: dict, state: dict,
                      model: nn.Module) -> torch.optim.Optimizer:
    """An optimizer of `cls` over `model`'s parameters, with the given groups, hyperparameters and state."""
    params = list(model.parameters())
    optimizer = cls([{"params": [params[i] for i in indices]} for indices in groups], **defaults)
    optimizer.load_state_dict(state)
    return optimizer


class NotAnOptimizer(TypeError):
    """The optimizer param's callable returned something else than a torch.optim.Optimizer."""


def optimizer_from_factory(factory: Any, model: nn.Module, lr: Optional[float] = None) -> torch.optim.Optimizer:
    """`factory(model.parameters())`, with `lr` (the estimator's param) over every group and the hyperparameters
    as Python numbers (a partial with numpy numbers would make checkpoints unloadable with weights_only=True). A
    model with adapters (peft_config) gives the factory its trainable parameters only (estimator.core.adapters)."""
    from estimator.core.adapters import is_adapted, trainable_parameters

    optimizer = factory(trainable_parameters(model) if is_adapted(model) else model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise NotAnOptimizer("The 'optimizer' parameter of TorchEstimator is a callable, which is called with the "
                        f"model's parameters; it returned {type(optimizer).__name__}, not a torch.optim.Optimizer. "
                        "Pass functools.partial(torch.optim.AdamW, lr=2e-5), or a function params -> optimizer.")
    for group in optimizer.param_groups:
        group.update({key: plain(value) for key, value in group.items() if key != "params"})
        if lr is not None:
            group["lr"] = lr
    optimizer.defaults = plain(optimizer.defaults)
    return optimizer


def rebind_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """The same optimizer over another instance of its model (after unpickling both apart)."""
    return rebuild_optimizer(type(optimizer), optimizer_groups(optimizer, model), constructor_defaults(optimizer),
                             optimizer.state_dict(), model)


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's defaults that its constructor accepts (load_state_dict restores the rest)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


_BY_VALUE_LOCK = threading.Lock()  # cloudpickle's by-value registry is global: fits in threads take turns


def dumps(obj: Any, what: str, roots: Iterable[Any] = (), for_executors: bool = True) -> bytes:
    """cloudpickle `obj`, pickling driver-only modules of `roots` by value. For the executors, with pyspark's own
    copy of cloudpickle (`pyspark.cloudpickle`, in the pyspark.zip every Python worker has): what is pickled by
    value then needs nothing installed there but pyspark. `for_executors=False` (a saved model or pipeline, read
    on a driver): the cloudpickle package, as saves of earlier releases were written."""
    if for_executors:
        try:
            from pyspark import cloudpickle as pickler
        except ImportError:  # no pyspark, no executors (LocalLauncher on a GPU host): the package serves
            import cloudpickle as pickler
    else:
        import cloudpickle as pickler
    with _BY_VALUE_LOCK:
        return _dumps(pickler, obj, what, driver_only_modules(roots))


def _dumps(pickler: ModuleType, obj: Any, what: str, modules: List[ModuleType]) -> bytes:
    registered = set(getattr(pickler.cloudpickle, "_PICKLE_BY_VALUE_MODULES", ()))
    modules = [m for m in modules if m.__name__ not in registered]  # leave the user's registrations
    for module in modules:
        pickler.register_pickle_by_value(module)
    try:
        return pickler.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - any pickling failure gets the same advice
        raise ValueError(unsendable(what, exc, obj)) from None
    finally:
        for module in modules:
            pickler.unregister_pickle_by_value(module)


def copied(obj: Any, what: str) -> Any:
    """A deep copy of the user's `obj` (its own stays untouched), refused as _dumps refuses what cannot travel."""
    try:
        return copy.deepcopy(obj)
    except Exception as exc:  # noqa: BLE001 - any copying failure gets the same advice
        raise ValueError(unsendable(what, exc, obj)) from None


def unsendable(what: str, exc: BaseException, obj: Any) -> str:
    where = holder(obj)
    return (f"The {what} cannot be sent to the Spark executors: {type(exc).__name__}: {exc}"
            + (f" (held by {where})" if where else "") + ". Objects that hold open files, locks, sockets, "
            "generators or Spark objects (SparkSession, DataFrame) cannot be pickled; keep such state out of the "
            "model, loss and metrics (create it where it is used, or leave it out in __getstate__).")


def holder(obj: Any) -> Optional[str]:
    """The attribute of a module (`model.cache.lock`) whose value cannot be copied, when one alone is to blame."""
    if not isinstance(obj, nn.Module):
        return None
    for name, module in obj.named_modules():
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers", "_modules") or attr.startswith("__"):
                continue
            try:
                copy.deepcopy(value)
            except Exception:  # noqa: BLE001 - whatever stops the copy
                return ".".join(["model", *([name] if name else []), attr])
    return None


def driver_only_modules(roots: Iterable[Any]) -> List[ModuleType]:
    """The modules that exist only on the driver and that pickling `roots` needs: those of their classes and
    functions, and, followed through the code of whatever is pickled by value (a notebook's class, a driver-only
    module's), those of the globals it refers to (a helper function in another driver-only file)."""
    pending: List[Any] = []
    for root in roots:
        items: Sequence[Any] = list(root.modules()) if isinstance(root, nn.Module) else [root]
        if isinstance(root, functools.partial):  # a factory: what it calls (a driver-only function, a class)
            items = [root.func, *root.args, *root.keywords.values()]
        for item in items:
            pending += [item if inspect.isclass(item) or inspect.isfunction(item) else type(item)]
    found: Dict[str, ModuleType] = {}
    seen: Set[int] = set()
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        name = item.__name__ if isinstance(item, ModuleType) else getattr(item, "__module__", None) or ""
        top = name.split(".")[0]
        if top != "__main__":
            module = sys.modules.get(top)
            if not top or top in _INSTALLED_EVERYWHERE or module is None or _is_installed(module):
                continue  # pickled by reference: executors import it
            found[top] = module
        if inspect.isclass(item):
            pending += list(item.__mro__[1:])  # a by-value class pickles its bases by reference
        if inspect.isclass(item) or inspect.isfunction(item):
            pending += list(_referenced_globals(item))
    return [found[name] for name in sorted(found)]


def _referenced_globals(item: Any) -> Iterator[Any]:
    """The global names the code of a class's methods (its own, not its bases') or of a function refers to."""
    functions = list(vars(item).values()) if inspect.isclass(item) else [item]
    for fn in functions:
        fn = fn.fget if isinstance(fn, property) else getattr(fn, "__func__", fn)  # properties, static/class methods
        code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if code is None or scope is None:
            continue
        for name in _code_names(code):
            if name in scope:
                yield scope[name]


def _code_names(code: Any) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if hasattr(const, "co_names"):  # nested functions, lambdas, comprehensions
            yield from _code_names(const)


def _is_installed(module: ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    if path is None:  # built-in or namespace package
        return True
    path = os.path.realpath(path)
    roots = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    return any(path.startswith(os.path.realpath(r) + os.sep) for r in roots if r)
