"""MLflow, from the driver: the tracking store is tried before any Spark job, params and facts are logged before
the launch, each epoch's row as the driver learns it, the model at the end. An optional extra (TensorBoard, on
rank 0: estimator.train.tensorboard).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import textwrap
import warnings
from typing import Any, Dict, Iterator, List, Optional

import torch

log = logging.getLogger("estimator")
RUN_TAG = "estimator.run_id"  # the store's run (store.run(run_id)), on each MLflow run a fit logs into


def check_mlflow(setting: Optional[bool]) -> None:
    """Before any Spark job, when the fit would log to MLflow (True, or None with an active run): the package is
    there and its tracking store answers. A store that cannot be used (an unreachable server, a database URI that
    mlflow-skinny cannot open, a file store refused without MLFLOW_ALLOW_FILE_STORE) is named with the fix here,
    rather than after training."""
    if setting is False:
        return
    if importlib.util.find_spec("mlflow") is None:
        if setting:
            raise ValueError("The 'mlflow' parameter of TorchEstimator is True but the mlflow package is not "
                             "installed: pip install mlflow (or mlflow-skinny), or set mlflow=None to log only when "
                             "it is there.")
        return
    import mlflow
    from mlflow.tracking import MlflowClient

    if not setting and mlflow.active_run() is None:
        return
    uri = mlflow.get_tracking_uri()
    try:
        with _env(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="10"):  # a dead server: seconds
            MlflowClient(uri).search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - whatever the store raises, the fix is the same
        first = brief((str(exc).strip().splitlines() or [""])[0], 300)
        raise ValueError(f"mlflow={setting!r}: MLflow's tracking store {uri!r} cannot be used "
                         f"({type(exc).__name__}: {first}). Point MLFLOW_TRACKING_URI (or mlflow.set_tracking_uri) at "
                         "a tracking server (http://host:5000), at a database URI with the full mlflow package (pip "
                         "install mlflow), or at a folder with MLFLOW_ALLOW_FILE_STORE=true; or set mlflow=False."
                         ) from None


def brief(text: str, width: int) -> str:
    """`text` within `width` characters, cut between words (MLflow's errors run to pages)."""
    return textwrap.shorten(text, width, placeholder=" ...")


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class MlflowLog:
    """The fit's MLflow run, logged as the fit goes: at `open` (before the ranks launch) the params and what people
    look for (the model's class and parameter count, the optimizer's class and lr, the loss, the ranks, the rows);
    each epoch's history row as the driver learns it (step = epoch: a long run is watched in the MLflow UI); at
    `finish` the rows not logged yet, the best epoch and the trained module. mlflow=None logs only into an active
    run; True starts one when none is; False never. A grid's fit (estimator.fit.grid) logs into a child run of
    the tuning's active run. The store's run_id is the tag RUN_TAG, and the name of a run the fit starts. Tracking never costs a trained model: a failure is a
    warning, and logging stops for the rest of the fit."""

    def __init__(self, run: Any, started: bool):
        self.run, self.started, self.logged, self.failed = run, started, set(), False

    @classmethod
    def open(cls, setting: Optional[bool], params: Dict[str, Any], about: Dict[str, Any], run_id: str,
             parent: Optional[str] = None, experiment: Optional[str] = None) -> Optional["MlflowLog"]:
        """The fit's run: a child of `parent` (a grid's fit under the tuning's active run, in `experiment`), else
        the active run, else one started (named as the store's run, `run_id`, as a child is)."""
        if setting is False or importlib.util.find_spec("mlflow") is None:
            return None
        import mlflow

        active = mlflow.active_run()
        if parent is not None:
            tracked = cls(mlflow.start_run(run_name=run_id, nested=True, parent_run_id=parent,
                                           experiment_id=experiment), True)
        elif active is None and not setting:
            return None
        else:
            tracked = cls(active or mlflow.start_run(run_name=run_id), active is None)
        tracked._try("its params", lambda: mlflow.log_params(
            {key: _param_text(value) for key, value in {**params, **about}.items() if value is not None}))
        tracked._try("its run's name", lambda: mlflow.set_tag(RUN_TAG, run_id))
        return tracked

    @property
    def run_id(self) -> str:
        return self.run.info.run_id

    def epoch(self, row: Dict[str, float]) -> None:
        epoch = int(row["epoch"])
        if epoch in self.logged or self.failed:
            return
        import mlflow

        self._try(f"epoch {epoch}", lambda: mlflow.log_metrics(
            {key: float(value) for key, value in row.items() if key != "epoch"}, step=epoch,
            run_id=self.run_id))
        self.logged.add(epoch)

    def finish(self, history: Any, best_epoch: Optional[int], model: Any) -> None:
        """The rest, and the run ended if this fit started it. `model`: the fitted TorchModel."""
        import mlflow
        import mlflow.pyfunc
        import mlflow.pytorch
        import torch

        for row in history:
            self.epoch(row)
        if best_epoch is not None:
            self._try("the best epoch", lambda: mlflow.log_metric("best_epoch", best_epoch, run_id=self.run_id))
        # the requirements given, so that MLflow does not spend seconds inferring them
        requirements = [f"torch=={torch.__version__.split('+')[0]}"]
        if model.getModelHandle() is not None:  # held as a handle: logged as one (estimator.predict.pyfunc)
            from estimator import __version__

            stored = model.getModelHandle().stored
            if hasattr(stored, "store"):  # the run's checkpoint (a full fine-tune's, fsdp's shards)
                log.warning("MLflow's model of this run holds no weights: where it is loaded it reads them from the "
                            "run's checkpoint, %s, which the store's run budget (or a hand) may remove later. To "
                            "register a model that stands alone, save it (model.save_pretrained(folder), or "
                            "model.save(path)) and log that folder.", stored.store.url(stored.path))

            self._try("the model", lambda: mlflow.pyfunc.log_model(
                name="model", python_model=model.as_pyfunc(),
                pip_requirements=[*requirements, *used_packages(), f"spark-torch-estimator=={__version__}"]))
        else:  # pickle: any module (the default 'pt2' traces forward with an example input)
            self._try("the model", lambda: mlflow.pytorch.log_model(
                model.getModel(), name="model", serialization_format="pickle", pip_requirements=requirements))
        self.end("FINISHED")

    def end(self, status: str) -> None:
        """The run ended if this fit started it: also after a failure to log (no run is left active)."""
        if self.started:
            import mlflow

            self.started = False
            self._try("the end of the run", lambda: mlflow.end_run(status=status), always=True)

    def _try(self, what: str, call: Any, always: bool = False) -> None:
        if self.failed and not always:
            return
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - tracking never costs the trained model
            if self.failed:
                return  # said once
            self.failed = True
            warnings.warn(f"Logging {what} to MLflow failed ({type(exc).__name__}: {brief(str(exc), 500)}); the fit "
                          "goes on and returns its model, and logs nothing more to MLflow. Its history is on the model "
                          "(getHistory()).", RuntimeWarning, stacklevel=2)


def model_facts(model: Any, optimizer: Any, lr: Optional[float], losses: Any, ranks: int, train_rows: int,
                val_rows: int) -> Dict[str, Any]:
    """What people look for in a tracked run besides the params."""
    return {"model_class": type(model).__name__,
            "model_parameters": sum(int(t.numel()) for t in model.parameters()), **optimizer_facts(optimizer, lr),
            "loss_class": ", ".join(type(fn).__name__ for fn in losses) or None,
            "ranks": ranks, "train_rows": train_rows, "val_rows": val_rows}


def optimizer_facts(optimizer: Any, lr: Optional[float]) -> Dict[str, Any]:
    """The optimizer's class and the lr it trains with: the lr param, else the optimizer's own. An optimizer given
    as a callable is named by what it calls (a partial's function or class, with its lr)."""
    recipe = optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer)
    made = getattr(optimizer, "func", optimizer)
    return {"optimizer_class": getattr(made, "__name__", type(made).__name__) if recipe else
            type(optimizer).__name__ if optimizer is not None else None,
            "optimizer_lr": lr or (getattr(optimizer, "keywords", {}).get("lr") if recipe else
                                   optimizer.param_groups[0].get("lr") if optimizer is not None else None)}


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 6000 else text[:5997] + "..."  # MLflow's limit for a param value


HANDLE_PACKAGES = ("transformers", "tokenizers", "peft", "bitsandbytes", "safetensors")  # what a handle may build with


def used_packages() -> List[str]:
    """The packages a handle's model may need where it is loaded (a Hugging Face model, its tokenizer, adapters,
    a quantized base), pinned to this process's versions: those of HANDLE_PACKAGES imported here."""
    import sys
    from importlib import metadata

    found = []
    for name in HANDLE_PACKAGES:
        if name in sys.modules:
            try:
                found.append(f"{name}=={metadata.version(name)}")
            except metadata.PackageNotFoundError:  # imported from a path, not installed: not pinned
                pass
    return found
