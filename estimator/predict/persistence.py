"""Save and load TorchEstimator and TorchModel.

Layout of a saved instance at `path`:
  metadata/     pyspark's DefaultParamsWriter JSON (class, uid, JSON params), so Pipeline and
                PipelineModel can save and load us like any other stage
  objects.pkl   the params that are Python objects (optimizer, loss, metrics, store without credentials)
  model.pkl     the nn.Module (its class and structure; cloudpickle)
  weights.pt    its state_dict, loaded with torch.load(weights_only=True)
or, for a TorchModel whose module was built by a `model` factory, no pickled module: its weights as safetensors
(or a Hugging Face folder) and module.json (estimator.predict.weights). An estimator's factory is a param like any
other (objects.pkl).
Loading runs code from model.pkl/objects.pkl: load only what you (or your pipeline) saved.
"""
from __future__ import annotations

import io
import posixpath
from typing import Any, Dict, Tuple

import cloudpickle
import torch
from torch import nn
from fsspec.core import url_to_fs
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter

from estimator.core.handle import ModelHandle, held, on_meta
from estimator.core.pickling import dumps, rebind_optimizer
from estimator.launch.session import metadata_session
from estimator.predict.weights import held_saved, load_module, save_module, standalone_base
from store import Store


class ParamsWriter(MLWriter):
    def __init__(self, instance: Any):
        super().__init__()
        self.instance = instance

    def save(self, path: str) -> None:
        """overwrite() removes what is at `path` through fsspec, as the objects are written: no JVM call, so
        that Spark Connect sessions save too."""
        if self.shouldOverwrite:
            fs, root = url_to_fs(path)
            if fs.exists(root):
                fs.rm(root, recursive=True)
        self.saveImpl(path)

    def saveImpl(self, path: str) -> None:
        json_params, objects = split_params(self.instance)
        DefaultParamsWriter.saveMetadata(self.instance, path, metadata_session(self), paramMap=json_params)
        fs, root = url_to_fs(path)
        handle = objects.pop("model_handle", None)  # rebuilt at load from the adapters saved
        model = objects.pop("model") if isinstance(objects.get("model"), nn.Module) else None
        # write().option("standalone", "true"): a model with adapters saved with its base (estimator.predict.weights)
        standalone = str(getattr(self, "optionMap", {}).get("standalone", "false")).lower() == "true"
        handle = held(model, handle)
        state = None  # a full fine-tune's state, mapped from its run's checkpoint: written, the model not built
        if handle is not None and (not handle.trained or standalone):  # saved whole
            state = handle.mapped(model, objects.get("optimizer"))
            if state is None:
                model, optimizer = handle.built_with(objects.get("optimizer"), model)  # the run's state read here
                if "optimizer" in objects:
                    objects["optimizer"] = optimizer
        built_by_factory = model is not None and objects.get("model_factory") is not None
        optimizer = objects.pop("optimizer", None) if built_by_factory else None
        if isinstance(objects.get("store"), Store):
            objects["store"] = objects["store"].without_credentials()
        if hasattr(objects.get("model_factory"), "without_credentials"):  # a loaded model's remote folder
            objects["model_factory"] = objects["model_factory"].without_credentials()
        _write(fs, posixpath.join(root, "objects.pkl"), dumps(objects, "params", roots=objects.values(), for_executors=False))
        if built_by_factory:
            save_module(model, optimizer, objects.get("tokenizer"), fs, root, standalone, state)
        elif model is not None:
            _write(fs, posixpath.join(root, "model.pkl"), dumps(model, "model", roots=[model], for_executors=False))
            buffer = io.BytesIO()
            torch.save(model.state_dict(), buffer)
            _write(fs, posixpath.join(root, "weights.pt"), buffer.getvalue())


class ParamsReader(MLReader):
    def __init__(self, cls: type):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        metadata = DefaultParamsReader.loadMetadata(path, metadata_session(self))
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        fs, root = url_to_fs(path)
        objects = cloudpickle.loads(_read(fs, posixpath.join(root, "objects.pkl")))
        # a base drawn at random is rebuilt as the ranks drew it (a TorchModel's; an estimator has none)
        seed = instance.getOrDefault("base_seed") if instance.hasParam("base_seed") else None
        base = standalone_base(fs, root)  # a standalone save's own base, instead of the fit's factory
        if base is not None:
            objects["model_factory"], seed = base, None
        # a full fine-tune's folder at a path the executors read: held as a handle, its weights not read here
        saved = held_saved(fs, root) if objects.get("model_factory") is not None else None
        built = load_module(fs, root, objects.get("model_factory"), seed) if saved is None else None
        if saved is not None:
            objects["model"], optimizer, objects["model_handle"] = saved
            if optimizer is not None:
                objects["optimizer"] = optimizer
        elif built is not None:
            objects["model"], optimizer = built
            if on_meta(objects["model"]):  # adapters on a base on meta: held as a handle (estimator.core.handle)
                model = objects["model"]
                objects["model_handle"] = ModelHandle.of(objects["model_factory"],
                                                         model.peft_config[model.active_adapter], model, seed)
            if optimizer is not None:
                objects["optimizer"] = optimizer
        elif fs.exists(posixpath.join(root, "model.pkl")):
            model = cloudpickle.loads(_read(fs, posixpath.join(root, "model.pkl")))
            weights = torch.load(io.BytesIO(_read(fs, posixpath.join(root, "weights.pt"))), map_location="cpu",
                                 weights_only=True)
            model.load_state_dict(weights)
            objects["model"] = model
            if objects.get("optimizer") is not None:  # pickled apart from the model: point it at its params
                objects["optimizer"] = rebind_optimizer(objects["optimizer"], model)
        instance._set(**objects)
        return instance


class Persistable(MLReadable, MLWritable):
    """Mixin: `write()`/`read()` for classes whose params come from a `declare` table."""

    def write(self) -> ParamsWriter:
        """A writer of this stage, Spark ML's: `write().overwrite().save(path)` replaces what is at `path`;
        `write().option("standalone", "true")` also saves a LoRA model's base beside its adapters
        (docs/models.md).

        Returns:
            The writer (`save(path)`, `overwrite()`, `option(key, value)`).
        """
        return ParamsWriter(self)

    @classmethod
    def read(cls) -> ParamsReader:
        """A reader of this class's saved stages, Spark ML's: `read().load(path)` is `load(path)`.

        Returns:
            The reader (`load(path)`).
        """
        return ParamsReader(cls)

    def save(self, path: str) -> None:
        """Save this stage to `path` (local, or any URL Spark's Hadoop file system reads: dbfs:/, abfss://,
        s3a://); a path that exists already is an error (`write().overwrite().save(path)` replaces it).

        Args:
            path: The folder to write: the params as Spark ML's metadata, the model's weights beside them.
        """
        self.write().save(path)



def split_params(instance: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(JSON params, object params) among the explicitly set params."""
    specs = instance._param_specs
    json_params, objects = {}, {}
    for param, value in instance._paramMap.items():
        (json_params if specs[param.name].json else objects)[param.name] = value
    return json_params, objects


def _write(fs: Any, path: str, data: bytes) -> None:
    with fs.open(path, "wb") as f:
        f.write(data)


def _read(fs: Any, path: str) -> bytes:
    with fs.open(path, "rb") as f:
        return f.read()
