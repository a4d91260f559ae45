"""What a run_id names: one fit, its rows and the params that decide what it trains. Launching a run again (after a
failure, in a new session, with more epochs) continues it; a fit under the run_id of a run that trained something
else is refused before it trains or returns anything. (It returned that run's model as its own: a wheel trial refit
a run_id with lr 0.5 on all rows and got the lr 1e-5 model of half the rows, no line said; a CrossValidator with a
run_id scored each fold after the first with the first fold's model, trained on the rows it scored.)

What a launch of the same run may change is how it runs: epochs (to train more), num_proc and batch_size (a run
goes on at another rank count: docs/failures.md), readers, retries and timeouts, logging, early stopping,
checkpoint cadence, compile, memory settings. The run's metadata keeps the rest when its first launch begins; a
run of an earlier release, without it, is not checked. No pyspark."""
from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Mapping, Optional

from estimator.failures import RunMismatch
from estimator.fit.tracking import optimizer_facts
from store import Store

# The params that decide what a run trains (each compared as given; lr as the optimizer's, when lr is None)
TRAINS = ("loss_weights", "feature_cols", "label_cols", "input_shapes", "label_shapes", "sample_weight_col",
          "validation", "train_steps_per_epoch", "shuffle", "drop_last", "random_seed", "max_length", "precision",
          "weights_folder", "gradient_clip_val", "lr_schedule", "warmup_steps", "warmup_ratio", "packing",
          "completion_only_loss", "chat_tools", "drop_nulls")


def params_identity(p: Mapping[str, Any], objective: Any) -> Dict[str, Any]:
    """The params (and what the objects say: the optimizer, the objective, LoRA's config) that decide what is
    trained, as JSON values."""
    facts = optimizer_facts(p["optimizer"], p["lr"])
    peft = p["peft_config"]
    made = {name: p[name] for name in TRAINS if name in p}
    made.update({"lr": facts["optimizer_lr"], "optimizer": facts["optimizer_class"],
                 "objective": type(objective).__name__ if objective is not None else None,
                 "peft_config": peft.to_dict() if hasattr(peft, "to_dict") else peft})
    return _json(made)


def check_same_run(store: Store, run: Any, run_id: str, params: Dict[str, Any], rows: Optional[str] = None) -> None:
    """Refuse (RunMismatch) a fit under `run_id` whose run has a checkpoint and was begun with other params or on
    other rows (`rows`: the data's identity, None where it is not known: the direct mode). `run`: its RunLayout."""
    if not store.exists(run.checkpoint) or not store.exists(run.metadata):
        return
    first = json.loads(store.read_bytes(run.metadata))  # its first launch's
    kept = first.get("params", {})
    changed = [f"{name}: {_text(kept[name])} (the run) and {_text(value)} (this fit)"
               for name, value in params.items() if name in kept and kept[name] != value]
    if rows is not None and first.get("rows") not in (None, rows):
        changed.append("the rows: this fit's data is not the data the run trained on")
    if changed:
        raise RunMismatch(
            f"run_id {run_id!r} names a run in the store ({store.url(run.root)}) that trained something else: "
            f"{'; '.join(changed)}. A run_id resumes its one fit (after a failure, or with more epochs), and this "
            "fit would continue or return that run's model. Use a new run_id (or leave run_id unset: each fit a "
            "run of its own, as in a CrossValidator, whose folds are fits of other rows), or remove that run's "
            "folder to train it again.")


def began(params: Dict[str, Any], rows: Optional[str]) -> Dict[str, Any]:
    """What the run's metadata keeps of its first launch (check_same_run's)."""
    return {"params": params, "rows": rows}


def pieces_identity(train: Any, val: Any) -> str:
    """Parquet already in the store (fit_on_parquet): its files, row groups and row counts."""
    listed = [[[piece.path, piece.row_group, piece.num_rows] for piece in pieces] for pieces in (train, val)]
    return "parquet:" + hashlib.sha256(json.dumps(listed).encode()).hexdigest()[:24]


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=_plain))


def _plain(value: Any) -> Any:
    """A value JSON has no form for: a set as its sorted items (LoRA's target_modules), else its repr."""
    return sorted(value, key=str) if isinstance(value, (set, frozenset)) else repr(value)


def _text(value: Any) -> str:
    return json.dumps(value)[:200]
