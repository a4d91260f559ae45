"""Every Param of TorchEstimator and TorchModel, declared once in a table.

`declare(cls, specs)` attaches the pyspark `Param` objects and generates `getX`/`setX`, the way
pyspark generates its shared params from a table. Validation runs at fit time, never in a
constructor, and every message has one form:
"The 'batch_size' parameter of TorchEstimator must be an int >= 1. Got 0 instead."
"""
from __future__ import annotations

import difflib
import inspect
import numbers
import re
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from pyspark.ml.param import Param, Params

from estimator.core.numbers import plain

Check = Callable[[Any], bool]


@dataclass(frozen=True)
class ParamSpec:
    name: str
    doc: str
    default: Any = None
    check: Optional[Check] = None  # True when the value is allowed
    allowed: str = ""  # what the message says is allowed: "an int >= 1"
    json: bool = True  # False: persisted by pickling (modules, callables, stores)
    hint: Optional[Callable[[Any], str]] = None  # the fix for a common wrong value ('' when it has none)


# -- checks ------------------------------------------------------------------------------------
def is_int(lo: Optional[int] = None, hi: Optional[int] = None) -> Check:
    def check(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            return False
        return (lo is None or v >= lo) and (hi is None or v <= hi)

    check.number = int  # type: ignore[attr-defined]  # what the param's converter makes of a number when set
    return check


def is_positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")


def is_non_negative(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")


is_positive.number = is_non_negative.number = float  # type: ignore[attr-defined]
is_seconds = is_positive


def optional(check: Check) -> Check:
    wrapped = lambda v: v is None or check(v)  # noqa: E731
    wrapped.number = getattr(check, "number", None)  # type: ignore[attr-defined]
    return wrapped


def is_instance(*types: type) -> Check:
    return lambda v: isinstance(v, types)


def is_str_list(nonempty: bool = True) -> Check:
    def check(v: Any) -> bool:
        return (isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v)
                and (len(v) > 0 or not nonempty) and len(set(v)) == len(v))

    return check


def is_shape_list(v: Any) -> bool:
    """A list of shapes; each a non-empty list of ints >= 1, where -1 may stand (once) for the batch."""
    if not isinstance(v, (list, tuple)):
        return False
    for shape in v:
        if not isinstance(shape, (list, tuple)) or not shape:
            return False
        if not all(is_int()(d) and (d >= 1 or d == -1) for d in shape):
            return False
        if list(shape).count(-1) > 1:
            return False
    return True


def is_callable_or_list(classes: bool = True) -> Check:
    """A callable or a non-empty list of them; `classes=False`: no class (`loss=nn.MSELoss` is the class, not a
    loss: calling it builds one)."""
    def one(f: Any) -> bool:
        return callable(f) and (classes or not inspect.isclass(f))

    return lambda v: (len(v) > 0 and all(one(f) for f in v)) if isinstance(v, (list, tuple)) else one(v)


def is_metric_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(callable(m) or m in ("accuracy",) for m in v)


def is_number_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(
        isinstance(x, numbers.Real) and not isinstance(x, bool) and x >= 0 for x in v)


def is_validation(v: Any) -> bool:
    if v is None or (isinstance(v, str) and v):
        return True
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 <= v < 1


def is_run_id(v: Any) -> bool:
    return v is None or (isinstance(v, str) and 0 < len(v) <= 200 and "/" not in v and "\\" not in v
                         and v not in (".", "..") and ".." not in v and not v.startswith("."))


def is_bool(v: Any) -> bool:
    return isinstance(v, bool)


# -- declaring ---------------------------------------------------------------------------------
def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def declare(cls: type, specs: Sequence[ParamSpec], refused: Optional[Dict[str, str]] = None) -> type:
    """Attach Params, getters and setters for `specs` to `cls` (a pyspark `Params` subclass). `refused`: names
    that are not params here but that users bring (another library's), with what to do instead."""
    cls._param_specs = {s.name: s for s in specs}  # type: ignore[attr-defined]
    cls._refused_names = dict(refused or {})  # type: ignore[attr-defined]
    for spec in specs:
        setattr(cls, spec.name, Param(Params._dummy(), spec.name, spec.doc, typeConverter=_converter(cls, spec)))
        for method in (_getter(spec.name), _setter(spec.name)):  # the class's own methods (help, the API pages)
            if method.__name__ in cls.__dict__:  # the class defines it itself (TorchModel.getModel)
                continue
            method.__qualname__, method.__module__ = f"{cls.__name__}.{method.__name__}", cls.__module__
            setattr(cls, method.__name__, method)
    params = [inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=s.default) for s in specs]
    cls.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + params)
    cls.__doc__ = inspect.cleandoc(cls.__doc__ or "") + "\n\n" + params_text(specs)  # what help(cls) lists
    return cls


def _converter(cls: type, spec: ParamSpec) -> Callable[[Any], Any]:
    """What a value set on the param becomes, as pyspark's TypeConverters do (setters, the constructor, copy(extra),
    a ParamGridBuilder's maps): numpy's numbers become Python's; an int param takes a whole float (5.0 -> 5); a
    number param refuses what is no number at once (TypeError). Ranges and the rest are checked at fit."""
    number = getattr(spec.check, "number", None)

    def convert(value: Any) -> Any:
        if not spec.json:  # modules, optimizers, callables, stores: as given
            return value
        value = plain(value)
        if number is None or value is None or isinstance(value, bool):
            return value
        if isinstance(value, str) and spec.check is not None and spec.check(value):
            return value  # a word the param allows besides numbers ('auto') stays as given
        if number is int and isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, numbers.Real):
            raise TypeError(param_error(cls.__name__, spec.name, spec.allowed, value))
        return value

    return convert


def _getter(name: str) -> Callable[[Params], Any]:
    def get(self: Params) -> Any:
        return self.getOrDefault(getattr(self, name))

    get.__name__ = "get" + _camel(name)
    get.__doc__ = f"Gets the value of `{name}`."
    return get


def _setter(name: str) -> Callable[[Params, Any], Params]:
    def set_(self: Params, value: Any) -> Params:
        return self._set(**{name: value})

    set_.__name__ = "set" + _camel(name)
    set_.__doc__ = f"Sets the value of `{name}`."
    return set_


class DeclaredParams(Params):
    """Base for classes whose params come from a `declare` table: records kwargs, nothing else."""

    _param_specs: Dict[str, ParamSpec] = {}
    _refused_names: Dict[str, str] = {}

    def __init__(self, **kwargs: Any):
        super().__init__()
        self._setDefault(**{name: spec.default for name, spec in self._param_specs.items()})
        self.setParams(**kwargs)

    def setParams(self, **kwargs: Any) -> "DeclaredParams":
        unknown = [k for k in kwargs if k not in self._param_specs]
        if unknown and unknown[0] in self._refused_names:
            raise TypeError(f"{type(self).__name__} has no parameter {unknown[0]!r}: "
                            f"{self._refused_names[unknown[0]]}")
        if unknown:
            hint = difflib.get_close_matches(unknown[0], list(self._param_specs), n=1)
            raise TypeError(f"{type(self).__name__} got an unexpected parameter {unknown[0]!r}."
                            + (f" Did you mean {hint[0]!r}?" if hint else "")
                            + f" Known parameters: {', '.join(sorted(self._param_specs))}.")
        return self._set(**kwargs)

    def validated(self) -> Dict[str, Any]:
        """All param values, each checked against its spec; raises ValueError naming the first bad one."""
        values = {}
        for name, spec in self._param_specs.items():
            value = self.getOrDefault(getattr(self, name))
            if spec.check is not None and not spec.check(value):
                hint = spec.hint(value) if spec.hint is not None else ""
                raise ValueError(param_error(type(self).__name__, name, spec.allowed, value) + (" " + hint if hint
                                                                                                 else ""))
            values[name] = value
        return values


def param_error(owner: str, name: str, allowed: str, value: Any) -> str:
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return f"The {name!r} parameter of {owner} must be {allowed}. Got {shown} instead."


def one_of(values: Sequence[Any]) -> str:
    """Allowed values as a message lists them: "None, 'generate' or 'embedding'" (a registry's names)."""
    shown = [repr(v) for v in values]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


def names(specs: Sequence[ParamSpec]) -> List[str]:
    return [s.name for s in specs]


# -- documentation -------------------------------------------------------------------------------
def default_text(spec: ParamSpec) -> str:
    """'required' for a param without a usable default, else the default's repr."""
    required = spec.default is None and spec.check is not None and not spec.check(None)
    return "required" if required else repr(spec.default)


def params_text(specs: Sequence[ParamSpec]) -> str:
    """The params as help() shows them under the class's docstring, from the same table as the param reference's."""
    example = _camel(specs[0].name)
    lines = [f"Params (keyword arguments; each also has a getter and a setter: get{example}(), set{example}(v)):"]
    for spec in specs:
        lines.append(f"    {spec.name}: {default_text(spec)}")
        lines += textwrap.wrap(f"{spec.doc}. Allowed: {spec.allowed}.", 100, initial_indent=" " * 8,
                               subsequent_indent=" " * 8, break_on_hyphens=False)
    return "\n".join(lines)


def breakable(text: str) -> str:
    """`text` with a line-break opportunity (<wbr>) after each dot of a dotted name outside code spans: a name such
    as estimator.train.strategies.STRATEGIES is one unbreakable word, which widened its table past the page's
    box (tests/test_docs.py lays the built tables out in a browser)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts lie outside backticks
        parts[i] = re.sub(r"\b(\w+(?:\.\w+){2,})\b", lambda m: m.group(1).replace(".", ".<wbr>"), parts[i])
    return "`".join(parts)


def markdown_table(specs: Sequence[ParamSpec], anchor: str = "") -> str:
    """The params as a Markdown table: the param reference's tables (docs/params.md) are this text, inserted by
    .ci/docs_hooks.py when the site is built. `anchor`: each row's name gets the anchor `<anchor><name>` (the
    site links params.md#estimator-batch_size)."""
    rows = ["| param | default | allowed | meaning |", "|---|---|---|---|"]
    for spec in specs:
        default = default_text(spec)
        default = default if default == "required" else f"`{default}`"
        # the name may wrap after an underscore (<wbr>): a long one no longer widens its column past the screen
        shown = "<code>" + spec.name.replace("_", "_<wbr>") + "</code>"
        name = f'<a id="{anchor}{spec.name}"></a>{shown}' if anchor else shown
        cells = [name, default, breakable(spec.allowed), breakable(spec.doc)]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"
