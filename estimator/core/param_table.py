"""The params of TorchEstimator and TorchModel: each declared once, here."""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from estimator.core.handle import ModelHandle
from estimator.core.params import (ParamSpec, is_bool, is_callable_or_list, is_instance, is_int, is_metric_list,
                              is_non_negative, is_number_list, is_positive, is_run_id, is_seconds, is_shape_list,
                              is_str_list, is_validation, optional)
from store import Store


def _loss_class_hint(v: Any) -> str:
    classes = [f for f in (v if isinstance(v, (list, tuple)) else [v]) if inspect.isclass(f)]
    return (f"{classes[0].__name__} is a class: pass an instance, {classes[0].__name__}() (with its arguments, if "
            "any), or the class in loss_constructors to build it on every rank.") if classes else ""


def _optimizer_list_hint(v: Any) -> str:
    if isinstance(v, (list, tuple)) and v and all(isinstance(o, torch.optim.Optimizer) for o in v):
        return ("The built-in loop steps one optimizer: for several, write your own loop with train_fn and keep "
                "each extra optimizer with ctx.keep(name, optimizer), which checkpoints and restores it "
                "(docs/training.md 'Your own training loop').")
    return ""


GENERATE_OWN = {"input_ids": "the prompts' tokens", "attention_mask": "the prompts' padding",
                "max_new_tokens": "its own param: set max_new_tokens",
                "max_length": "the length generated is the max_new_tokens param, which generate() lets overrule "
                              "max_length: set max_new_tokens"}  # generate() keywords the transform sets


def _one_text_a_row(v: Any) -> bool:
    """transform writes one text a row: generate() returning several a prompt failed on the executors."""
    return not isinstance(v, dict) or v.get("num_return_sequences") in (None, 1)


def _clip_ok(v: Any) -> bool:
    return (isinstance(v, str) and v == "auto") or optional(is_positive)(v)


_clip_ok.number = float  # type: ignore[attr-defined]  # a number set is a float; 'auto' stays as given


def _generate_kwargs_ok(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and all(isinstance(k, str) and k not in GENERATE_OWN for k in v)
                         and _one_text_a_row(v))


def _generate_kwargs_hint(v: Any) -> str:
    taken = [k for k in (v if isinstance(v, dict) else ()) if k in GENERATE_OWN]
    if taken:
        return f"{taken[0]!r} is set by the transform ({GENERATE_OWN[taken[0]]}): leave it out of generate_kwargs."
    if not _one_text_a_row(v):
        return (f"num_return_sequences={v['num_return_sequences']!r}: transform writes one text a row. For several "
                "samples of a prompt, repeat its row (df.crossJoin(spark.range(k))) with do_sample=True.")
    return ""


TOKENIZER = ParamSpec("tokenizer", "a Hugging Face tokenizer, or a callable(list of str) -> dict of arrays: string "
                      "feature columns are tokenized with it on the ranks (the reader's workers) and in transform, "
                      "padded per batch, and reach forward by keyword (input_ids=..., attention_mask=...; "
                      "docs/training.md 'Train on text columns')", None, optional(callable),
                      "a tokenizer (a callable) or None", json=False)

ESTIMATOR_PARAMS = [
    ParamSpec("num_proc", "number of training processes (Spark barrier tasks); default: every task slot, when the "
              "session can tell (docs/connect.md 'Spark Connect and Databricks')", None, optional(is_int(1)),
              "an int >= 1 or None"),
    ParamSpec("store", "where materialized data, checkpoints and logs go; default: a local temporary folder",
              None, optional(is_instance(Store)), "a store.Store (Store.create(url)) or None", json=False),
    ParamSpec("model", "the torch.nn.Module to train (fit trains a copy), or a lightning.LightningModule (its hooks "
              "run in the estimator's loop: docs/training.md 'Train a LightningModule'), or a zero-argument "
              "callable that builds it on every rank, so that pretrained weights load there from their path "
              "(docs/training.md 'Build the model on the ranks')", None, callable,
              "a torch.nn.Module, or a callable() returning one", json=False),
    ParamSpec("optimizer", "a torch.optim.Optimizer over the model's parameters, rebuilt on every rank, or a "
              "callable(params) -> Optimizer called with each rank's parameters (functools.partial(torch.optim.AdamW, "
              "lr=2e-5)); required unless model is a LightningModule (configure_optimizers)", None,
              optional(lambda v: isinstance(v, torch.optim.Optimizer) or callable(v)),
              "a torch.optim.Optimizer built over model.parameters(), or a callable(params) returning one",
              json=False, hint=_optimizer_list_hint),
    ParamSpec("lr", "learning rate of every param group (None: the optimizer's own); a ParamGridBuilder can vary "
              "it", None, optional(is_positive), "a number > 0 or None"),
    ParamSpec("loss", "loss callable(output, label), or one per label column; required unless loss_constructors, "
              "train_step or train_fn is set, or model is a LightningModule", None,
              optional(is_callable_or_list(classes=False)),
              "a callable such as nn.CrossEntropyLoss(), or a list of them (one per label column)", json=False,
              hint=_loss_class_hint),
    ParamSpec("loss_weights", "weight of each label's loss in the total; default 1/len(label_cols) each", None,
              optional(is_number_list), "a list of numbers >= 0 (one per label column) or None"),
    ParamSpec("metrics", "metrics per epoch: 'accuracy' or callables(output, label) -> number", [],
              is_metric_list, "a list of 'accuracy' or callables(output, label)", json=False),
    ParamSpec("feature_cols", "columns passed to model.forward(), in order", None, is_str_list(),
              "a non-empty list of distinct column names"),
    ParamSpec("label_cols", "label columns, one per model output; optional when the loop computes its own loss "
              "(a LightningModule, train_step or train_fn: self-supervised models, autoencoders)", None,
              optional(is_str_list()), "a non-empty list of distinct column names, or None"),
    ParamSpec("input_shapes", "shape of each feature batch, e.g. [[-1, 1, 28, 28]] (-1: the batch; without -1, a shape "
              "holding a row's values is per row, as in Horovod); default: as stored", None,
              optional(is_shape_list), "a list of shapes like [[-1, 1, 28, 28]] or None"),
    ParamSpec("label_shapes", "shape of each label batch (-1: the batch)", None, optional(is_shape_list),
              "a list of shapes like [[-1, 3]] or None"),
    ParamSpec("sample_weight_col", "column of per-row loss weights", None, optional(is_instance(str)),
              "a column name or None"),
    ParamSpec("validation", "fraction of rows held out (0 <= v < 1), or a column that is true (or non-zero) for "
              "validation rows, false, 0 or null for training rows. "
              "A fraction holds out each row by a hash of its values and random_seed: about v of the rows (200 "
              "rows at 0.2: 40, give or take 6), the same rows at every fit, identical rows on the same side. A "
              "validation DataFrame of its own: union it with the training rows, marked by such a column",
              None, is_validation, "a float in [0, 1), a column name, or None"),
    ParamSpec("batch_size", "rows per training batch on each rank", 32, is_int(1), "an int >= 1"),
    ParamSpec("val_batch_size", "rows per validation batch; default batch_size", None, optional(is_int(1)),
              "an int >= 1 or None"),
    ParamSpec("epochs", "passes over the training data", 1, is_int(1), "an int >= 1"),
    ParamSpec("train_steps_per_epoch", "batches per epoch on every rank; default: one pass over the largest shard",
              None, optional(is_int(1)), "an int >= 1 or None"),
    ParamSpec("validation_steps_per_epoch", "validation batches per epoch; default: all validation rows", None,
              optional(is_int(1)), "an int >= 1 or None"),
    ParamSpec("shuffle", "shuffle each rank's rows every epoch", True, is_bool, "True or False"),
    ParamSpec("drop_last", "every training batch full, on every rank, every epoch (models with state across "
              "batches, BatchNorm on tiny batches): the rows that would make a smaller last batch are not trained "
              "that epoch (other rows each epoch when shuffled); validation sees every row", False, is_bool,
              "True or False"),
    ParamSpec("random_seed", "seed of the split, shuffling, dropout and what a model factory (and peft_config's "
              "adapters) draws on the ranks; default: the shuffles are drawn at fit time and "
              "the split is fixed (so refits reuse one materialized copy of the data)", None,
              optional(is_int(0)), "an int >= 0 or None"),
    ParamSpec("run_id", "name of the run folder in the store; default: a new unique id", None, is_run_id,
              "a name without '/', '\\\\' or '..', or None"),
    ParamSpec("use_gpu", "None: GPUs when every rank has one; True: require them; False: CPU", None,
              optional(is_bool), "True, False or None"),
    ParamSpec("verbose", "0: prints nothing; 1: a line per epoch on the driver's stderr while training runs (notebooks "
              "show it, no logging setup needed); 2: also a live tqdm bar of each epoch's steps (rows/s, running loss), "
              "fed by rank 0 through the store about once a second",
              1, is_int(0, 2), "0, 1 or 2"),
    ParamSpec("backend", "Horovod compatibility: an object with num_processes() (estimator.backend.SparkBackend); "
              "excludes num_proc", None, optional(lambda v: callable(getattr(v, "num_processes", None))),
              "an object with a num_processes() method, such as SparkBackend(num_proc=2), or None", json=False),
    ParamSpec("loss_constructors", "zero-argument functions that build the losses on each rank (instead of loss)",
              None, optional(is_callable_or_list()), "a list of zero-argument callables returning losses, or None",
              json=False),
    ParamSpec("transformation_fn", "function(pandas.DataFrame) -> pandas.DataFrame applied to every training and "
              "validation batch", None, optional(callable), "a callable or None", json=False),
    TOKENIZER,
    ParamSpec("max_length", "tokens kept per text (longer texts are truncated); None: the tokenizer's model maximum, "
              "at most the model's positions (a Hugging Face config's max_position_embeddings)",
              None, optional(is_int(1)), "an int >= 1 or None"),
    ParamSpec("train_step", "your training step: function(model, batch, ctx) -> the loss (a scalar tensor) or a dict "
              "with 'loss' and other numbers (history keys); the estimator does backward, precision, clipping, "
              "the optimizer step, validation (the same function, ctx.training False) and checkpoints. loss is then "
              "optional: given, it only says what transform's outputs are (docs/training.md 'Your own training "
              "step')", None, optional(callable), "a callable(model, batch, ctx) or None", json=False),
    ParamSpec("train_fn", "your whole training loop: function(ctx) run on every rank, over the estimator's data, "
              "model, optimizer, checkpoints and history (ctx.epochs_to_run(), ctx.train_batches(), ctx.report(...); "
              "docs/training.md 'Your own training loop'); loss is then optional, as with train_step", None,
              optional(callable), "a callable(ctx) or None", json=False),
    ParamSpec("reader", "how ranks read their shards: 'arrow' (pyarrow, in memory or streaming) or 'petastorm'",
              "arrow",
              lambda v: v in ("arrow", "petastorm"), "'arrow' or 'petastorm'"),
    ParamSpec("train_reader_num_workers", "arrow reader: workers (reader_pool_type) that run transformation_fn on "
              "training batches (default: on a GPU rank, one process per core the rank has on its host, less one; "
              "else 2 threads; without a transformation_fn, the one feeding thread); petastorm: its reader "
              "workers", None,
              optional(is_int(1)), "an int >= 1 or None"),
    ParamSpec("val_reader_num_workers", "the same for validation batches", None, optional(is_int(1)),
              "an int >= 1 or None"),
    ParamSpec("reader_pool_type", "what runs transformation_fn (arrow) or reads (petastorm): 'thread', 'process' "
              "(no GIL: faster for image decoding), 'dummy' (the feeding thread), or 'auto': processes on a GPU rank "
              "with a transformation_fn (the GPU waits for a GIL-bound decoder otherwise), else threads", "auto",
              lambda v: v in ("auto", "thread", "process", "dummy"), "'auto', 'thread', 'process' or 'dummy'"),
    ParamSpec("mp_start_method", "start method of the arrow reader's decoding processes (reader_pool_type='process'; "
              "default 'fork' on Linux, as torch's DataLoader; 'spawn' or 'forkserver' when transformation_fn uses "
              "threads or CUDA)", None,
              lambda v: v in (None, "fork", "spawn", "forkserver"), "'fork', 'spawn', 'forkserver' or None"),
    ParamSpec("inmemory_cache_all", "True: keep each rank's shard in memory; False: stream it from the store every "
              "epoch; None: in memory when it fits the rank's memory budget (docs/data.md 'Reading data')", None,
              optional(is_bool), "True, False or None"),
    ParamSpec("shuffle_buffer_size", "rows of the streaming reader's shuffle buffer (default: as many as fit 64 MB, "
              "1,000-100,000)", None,
              optional(is_int(0)), "an int >= 0 or None"),
    ParamSpec("checkpoint_steps", "rank 0 also checkpoints every N optimizer steps, with the reader's position, so a "
              "retry or a refit resumes inside the epoch; None: at epoch ends only", None, optional(is_int(1)),
              "an int >= 1 or None"),
    ParamSpec("checkpoint_async", "rank 0 copies the state to the CPU and writes each checkpoint from a background "
              "thread while training goes on (one write at a time; a failed write fails the run); False: training "
              "waits for every write", True, is_bool, "True or False"),
    ParamSpec("early_stopping_patience", "stop after this many epochs in which `monitor` did not improve by more "
              "than min_delta (all ranks decide together); None: train every epoch", None, optional(is_int(1)),
              "an int >= 1 or None"),
    ParamSpec("monitor", "the history key that decides the best epoch, the kept checkpoints and early stopping; "
              "default 'val_loss' with validation data, else 'loss'", None, optional(is_instance(str)),
              "a history key such as 'val_loss', 'loss' or 'val_accuracy', or None"),
    ParamSpec("monitor_mode", "'min' or 'max': which way `monitor` improves; default 'max' for names containing "
              "'accuracy', else 'min'", None, lambda v: v in (None, "min", "max"), "'min', 'max' or None"),
    ParamSpec("min_delta", "the smallest change of `monitor` that counts as an improvement for early stopping", 0.0,
              is_non_negative, "a number >= 0"),
    ParamSpec("restore_best", "the TorchModel gets the weights of the best epoch by `monitor` (False: the last "
              "epoch's)", False, is_bool, "True or False"),
    ParamSpec("save_top_k", "checkpoints of the best epochs by `monitor` kept in the run folder (runs/<run_id>/best) "
              "besides the last one", 1, is_int(0), "an int >= 0"),
    ParamSpec("precision", "'32'; 'bf16-mixed': forward and loss under torch.autocast in bfloat16 (CPU or GPU); "
              "'16-mixed': float16 autocast with a GradScaler (CUDA only)", "32",
              lambda v: v in ("32", "bf16-mixed", "16-mixed"), "'32', 'bf16-mixed' or '16-mixed'"),
    ParamSpec("compile", "torch.compile the model on every rank before DistributedDataParallel wraps it (with "
              "strategy='fsdp': each unit before it is sharded): False, True, or a dict of torch.compile keyword "
              "arguments (e.g. {'mode': 'max-autotune'}); checkpoints and the TorchModel hold the plain module's "
              "weights", False,
              lambda v: isinstance(v, bool) or (isinstance(v, dict) and all(isinstance(k, str) for k in v)),
              "True, False or a dict of torch.compile keyword arguments"),
    ParamSpec("strategy", "'ddp': every rank holds the whole model, its gradients and the optimizer's state, and "
              "DistributedDataParallel averages the gradients; 'fsdp': parameters, gradients and optimizer state "
              "sharded over the ranks (FSDP2's fully_shard), each rank writing its own shards of the checkpoints "
              "(docs/gpus.md 'Shard a large model'); 'auto': fsdp's checkpoints and limits, the model sharded only "
              "on GPU ranks that could not hold its parameters, gradients and Adam's state in half their memory, else "
              "trained whole as with ddp (said in the log)", "ddp", is_instance(str),
              "the name of a strategy ('ddp', 'fsdp' or 'auto': estimator.train.strategies.STRATEGIES)"),
    ParamSpec("shard_units", "with strategy='fsdp', the submodules sharded as units, each gathered whole only for "
              "its own forward and backward: None, the items of every nn.ModuleList (a transformer's blocks); a "
              "list of nn.Module classes; or a callable(module) -> bool. The whole model is the last unit", None,
              optional(lambda v: callable(v) and not inspect.isclass(v) or (
                  isinstance(v, (list, tuple)) and len(v) > 0
                  and all(inspect.isclass(c) and issubclass(c, nn.Module) for c in v))),
              "None, a list of nn.Module classes, or a callable(module) -> bool", json=False),
    ParamSpec("reshard_after_forward", "with strategy='fsdp': True frees each unit's gathered parameters after its "
              "forward and gathers them again for its backward (the least memory); False keeps them gathered "
              "until the backward (one gather a unit per step instead of two, each rank holding the whole units "
              "between the passes). FSDP2's own option, for every unit but the whole model", True, is_bool,
              "True or False"),
    ParamSpec("weights_folder", "a folder of .safetensors files (a save_pretrained folder) on the driver's and every "
              "executor's file system, holding by state-dict name (or through base_model_prefix, as from_pretrained "
              "reads) the weights a `model` factory leaves on the meta device (estimator.parameters_on_meta()): "
              "each rank reads only its own shards of them with "
              "strategy='fsdp', the whole with 'ddp', and what the factory built with values is kept (docs/gpus.md "
              "'Build the model on the meta device'). None: the model has all its weights",
              None, optional(lambda v: isinstance(v, str) and v != ""), "a folder path, or None"),
    ParamSpec("peft_config", "a peft config (LoraConfig(r=16, lora_alpha=32, target_modules='all-linear', "
              "task_type='CAUSAL_LM')): its adapters are added to the model on every rank, the base is frozen, and "
              "only the trainable parameters reach the optimizer, the gradient averaging, the checkpoints and the "
              "resume (docs/language-models.md)", None, lambda v: v is None or hasattr(v, "peft_type"),
              "a peft config such as peft.LoraConfig(...), or None", json=False),
    ParamSpec("objective", "what a causal LM is trained to do, where it is not the next-token loss the other params "
              "choose: DPO(beta=0.1) (from estimator) tunes it on preference pairs, the prompt the feature column "
              "and label_cols=['chosen', 'rejected'] two string columns (or all three message lists); its "
              "reference is the model with its adapters off under peft_config, else log-probabilities computed "
              "once before training (DPO's reference); GRPO(reward_funcs=...) samples completions of the prompts "
              "and reinforces those its reward functions score above their group's mean. None: chosen from the "
              "other params (docs/language-models.md 'Tune on preference pairs (DPO)', 'Reinforce with rewards "
              "(GRPO)')", None,
              lambda v: v is None or (hasattr(v, "applies") and hasattr(v, "for_rank")),
              "an objective such as DPO(beta=0.1), or None", json=False),
    ParamSpec("gradient_checkpointing", "recompute activations in backward instead of keeping them: True "
              "recomputes all of them (least memory, about a third more compute); 'selective' keeps the outputs of "
              "attention and of the wide matrix products and recomputes the rest (norms, activation functions, "
              "adapters). A Hugging Face model through its own gradient_checkpointing_enable(), other models per "
              "unit (the items of every nn.ModuleList, or shard_units)", False,
              lambda v: isinstance(v, bool) or v == "selective", "True, False or 'selective'"),
    ParamSpec("max_new_tokens", "transform of a causal LM (fitted on a string label, or output_kind='generate'): "
              "the most tokens generated per row (generation also stops at eos)", 64, is_int(1), "an int >= 1"),
    ParamSpec("generate_kwargs", "transform of a causal LM: keyword arguments of model.generate, e.g. "
              "{'do_sample': True, 'temperature': 0.7, 'top_p': 0.9, 'seed': 0} ('seed' seeds the sampling of each "
              "batch of prompts: the same prompts in the same batches give the same text, and another "
              "inference_batch_size or partitioning other text); default greedy decoding", None,
              _generate_kwargs_ok, "a dict of model.generate keyword arguments (not input_ids, attention_mask, "
              "max_new_tokens or max_length; num_return_sequences 1), or None", hint=_generate_kwargs_hint),
    ParamSpec("generation_batching", "transform of a causal LM: how each Arrow batch's prompts are generated. "
              "'continuous': transformers' continuous batching (a paged KV cache; a row leaves the running batch the "
              "step it ends and a waiting prompt takes its place; CUDA graphs on a GPU); 'padded': model.generate "
              "over batches of prompts sorted by length, left-padded (inference_batch_size); 'auto': continuous on "
              "a GPU where the model has it and generate_kwargs holds only do_sample, temperature, top_k, top_p, "
              "eos_token_id, pad_token_id and seed, else padded (on a CPU continuous batching is slower: "
              "docs/language-models.md 'Continuous batching on a GPU')", "auto",
              lambda v: v in ("auto", "continuous", "padded"), "'auto', 'continuous' or 'padded'"),
    ParamSpec("gradient_clip_val", "clip the global gradient norm (over all ranks' averaged gradients) to this before "
              "each optimizer step; 'auto': 1.0 for a causal LM's fine-tuning (SFT, DPO), as Hugging Face's Trainer "
              "under TRL clips by default (max_grad_norm=1.0), no clipping for other fits; None: no clipping",
              "auto", _clip_ok, "a number > 0, 'auto' or None"),
    ParamSpec("log_every_n_steps", "the training loss goes to TensorBoard (when the tensorboard package is installed) "
              "every N optimizer steps; epoch figures go every epoch", 50, is_int(1), "an int >= 1"),
    ParamSpec("mlflow", "log params, every epoch's metrics, the best epoch and the trained model to MLflow: None when "
              "mlflow is installed and a run is active at fit; True always (a run is started when none is); False "
              "never", None, optional(is_bool), "True, False or None"),
    ParamSpec("data_mode", "'materialize': the rows are written to the store as Parquet once and reused by later fits "
              "on the same rows; 'direct': no copy, the ranks take their rows from the DataFrame's own Spark stage "
              "and keep them on local disk for the fit (docs/data.md 'Choose materialize or direct')", "materialize",
              lambda v: v in ("materialize", "direct"), "'materialize' or 'direct'"),
    ParamSpec("partitions_per_process", "Parquet files written per process when materializing; default: the "
              "DataFrame's partitions, at least one per process", None, optional(is_int(1)), "an int >= 1 or None"),
    ParamSpec("backward_passes_per_step", "batches whose gradients are accumulated before each optimizer step", 1,
              is_int(1), "an int >= 1"),
    ParamSpec("gradient_compression", "Compression.fp16 to allreduce gradients in float16", None,
              lambda v: v is None or getattr(v, "name", v) in ("none", "fp16"),
              "Compression.none, Compression.fp16 or None", json=False),
    ParamSpec("shared_memory_allreduce", "on CPU, when all ranks run on one host, average gradients through a "
              "shared-memory file in /dev/shm instead of gloo over loopback (about 2x the rows/s for small models, "
              "benchmarks/RESULTS.md); ranks on several hosts, without /dev/shm or on non-x86 CPUs use gloo either "
              "way", True, is_bool, "True or False"),
    ParamSpec("terminate_on_nan", "fail the fit with NonFiniteLoss (epoch, step, rank) when a training loss, an "
              "epoch's loss or the weights are NaN or infinite, before such weights are checkpointed; False: train "
              "on, with a warning for each such epoch (Horovod's default was False)", True, is_bool,
              "True or False"),
    ParamSpec("lr_scheduler_fn", "function(optimizer) -> a torch.optim.lr_scheduler scheduler, built on every rank "
              "and stepped once per epoch (ReduceLROnPlateau with val_loss, else loss), or Lightning's dict "
              "{'scheduler': ..., 'interval': 'step'} to step it after every optimizer step (OneCycleLR); "
              "checkpointed and resumed",
              None, optional(callable), "a callable taking the optimizer, or None", json=False),
    ParamSpec("packing", "a causal LM's rows of each batch in one sequence with no padding, each row's "
              "positions from 0 and its attention confined to itself at the cost of its own length (flash "
              "attention over the rows' boundaries on a GPU in half precision, else row by row): the same loss "
              "and gradients as unpacked, no padded tokens computed. The batch is what is packed, so batch_size "
              "still counts rows, and resumes and ranks are as without it; shuffled, the rows of every 8 batches a "
              "rank draws are dealt anew over them so the batches are about equally long", False, is_bool, "True or False"),
    ParamSpec("completion_only_loss", "a causal LM's loss over the response's tokens only (a chat's assistant "
              "turns), as TRL's SFTTrainer's default; False: over every token of the row, the prompt (the whole "
              "conversation) too. A text column with no label column learns every token either way (continued "
              "pretraining)", True, is_bool, "True or False"),
    ParamSpec("chat_tools", "the tools a chat column's conversations may call, as a list of function schemas "
              "(dicts, as transformers' apply_chat_template(tools=...) takes them): given to the chat template "
              "with every conversation, in training and in generation. Messages may hold tool_calls (an "
              "assistant's), name and tool_call_id (a 'tool' message's): the template renders them, and a field "
              "the template never reads is refused before any job", None,
              lambda v: v is None or (isinstance(v, (list, tuple)) and all(isinstance(t, dict) for t in v)),
              "a list of dicts or None"),
    ParamSpec("output_kind", "what transform adds (set on the estimator: its fitted model's, "
              "so that a tuning's evaluator reads it; unset there, a causal LM's fit gives 'generate'): None, the "
              "model's outputs (and the prediction columns of a "
              "classifier or regressor); 'generate', the text a causal LM generates for the prompt (or chat) column, "
              "as strings in prediction_col (and the label's output column); 'embedding', a vector per row from a "
              "model whose output is hidden states (the mean over the attention mask of the last hidden state); "
              "'score', each row's log-likelihood under a causal LM: logprob, tokens, perplexity and truncated (the "
              "response given the prompt where label_cols names it, a chat's assistant turns, else the whole text)",
              # only its type here: which values exist is the registry's (estimator.predict.kinds.PREDICTORS),
              # which TorchModel asks (its message lists the registry's values)
              None, optional(is_instance(str)), "None, 'generate', 'embedding' or 'score'"),
    ParamSpec("inference_batch_size", "rows per forward() or generate() call in transform (set on the estimator: "
              "its fitted model's). None: 1,024 rows (a fit's model: the larger of val_batch_size or batch_size "
              "and 256); with output_kind='generate', as many prompts, shortest first, as keep rows x (their "
              "longest prompt + max_new_tokens) within 65,536 tokens a call on a GPU, 16,384 on a CPU (the KV cache "
              "grows with it; continuous batching takes the prompts as it goes instead); with "
              "output_kind='embedding', at most that many texts a forward, shortest first, rows x their longest "
              "within 16,384 tokens", None,
              optional(is_int(1)), "an int >= 1 or None"),
    ParamSpec("lr_schedule", "the learning rate after each optimizer step: 'constant', 'linear' (decays to 0 at "
              "the run's last step) or 'cosine' (a half cosine to 0), after a linear warmup from 0 of warmup_steps "
              "or warmup_ratio of the run's steps; as Hugging Face's get_*_schedule_with_warmup (TRL's); "
              "checkpointed and resumed; the history's 'lr' is the rate at each epoch's end. None: the optimizer's "
              "lr throughout (or lr_scheduler_fn's)", None,
              lambda v: v is None or v in ("constant", "linear", "cosine"), "'constant', 'linear', 'cosine' or None"),
    ParamSpec("warmup_steps", "optimizer steps of lr_schedule's linear warmup from 0 (a warmup without lr_schedule "
              "is followed by a constant rate)", None, optional(is_int(0)), "an int >= 0 or None"),
    ParamSpec("warmup_ratio", "lr_schedule's warmup as a fraction of the run's optimizer steps (rounded up)", None,
              lambda v: v is None or (is_non_negative(v) and v < 1), "a number in [0, 1) or None"),
    ParamSpec("drop_nulls", "skip rows with a null (or an array holding a null) in any feature, label or weight "
              "column; default False: such rows are an error naming the column and count", False, is_bool,
              "True or False"),
    ParamSpec("handle_invalid", "transform's rows with a null (or an array holding a null) in a column it reads "
              "(set on the estimator: its fitted model's), as Spark ML's handleInvalid: 'error' fails the job naming "
              "the column; 'keep' gives such a row null outputs and keeps it; 'skip' leaves it out of the result. "
              "A NaN is a value, not a null (its row gets NaN outputs). Training's are drop_nulls'", "error",
              lambda v: v in ("error", "keep", "skip"), "'error', 'keep' or 'skip'"),
    ParamSpec("max_retries", "times a failed training launch is retried from the last checkpoint; default: "
              "spark.task.maxFailures - 1 (0 in local[N] mode)", None, optional(is_int(0)), "an int >= 0 or None"),
    ParamSpec("min_num_proc", "the fewest ranks a retry may go on with when a lost executor took task slots with it "
              "(the global batch kept: docs/failures.md 'A lost executor'); default num_proc: a retry waits "
              "rendezvous_timeout for the slots, then fails", None, optional(is_int(1)), "an int >= 1 or None"),
    ParamSpec("rendezvous_timeout", "seconds for all ranks to meet before training; a late rank is named in the "
              "error", 120.0, is_seconds, "a number of seconds > 0"),
    ParamSpec("collective_timeout", "seconds a rank waits for its peers in one collective (gloo/nccl process "
              "group timeout)", 1800.0, is_seconds, "a number of seconds > 0"),
    ParamSpec("callbacks", "objects whose on_train_begin(logs) / on_epoch_end(epoch, logs) / on_train_end(logs) "
              "run on rank 0 (epoch counts from 0, as Keras' and Horovod's: the history's epoch 1 is "
              "on_epoch_end(0, ...))", [], lambda v: isinstance(v, (list, tuple)), "a list of callback objects", json=False),
]

MODEL_PARAMS = [
    ParamSpec("model", "the trained torch.nn.Module", None, is_instance(nn.Module), "a torch.nn.Module", json=False),
    ParamSpec("model_factory", "the zero-argument callable that built the model at fit time (None: the model was "
              "given as an instance). With it, save writes the trained weights as safetensors (a Hugging Face "
              "model: its save_pretrained folder) instead of pickling the module, and load rebuilds it",
              None, optional(callable), "a callable() returning a torch.nn.Module, or None", json=False),
    ParamSpec("model_handle", "what rebuilds the trained model where it is needed, held instead of its weights "
              "(a LoRA fit of a model factory: the factory, peft_config and the trained adapters; "
              "estimator.core.handle): transform sends it, and `model` is then the module on the meta device with "
              "the adapters' values", None, optional(is_instance(ModelHandle)),
              "a ModelHandle or None", json=False),
    ParamSpec("base_seed", "the seed the ranks built the model under (the fit's drawn seed): a base that the "
              "model factory draws at random is rebuilt under it where the adapters go on it (transform, load)",
              None, optional(is_int(0)), "an int >= 0 or None"),
    ParamSpec("optimizer", "the optimizer at the end of training, over the trained model's parameters", None,
              optional(is_instance(torch.optim.Optimizer)), "a torch.optim.Optimizer or None", json=False),
    ParamSpec("feature_cols", "columns passed to forward(), in order", None, is_str_list(),
              "a non-empty list of column names"),
    ParamSpec("label_cols", "the label columns the model was trained on (one per output; none for a model trained "
              "without labels, or built without a fit)", [], is_str_list(nonempty=False), "a list of column names"),
    ParamSpec("output_cols", "names of the output columns; default '<label>__output'", None,
              optional(is_str_list()), "a list of column names (one per label column) or None"),
    ParamSpec("prediction_col", "the predicted class (classification) or value (one regression output per row) "
              "('' for none)", "prediction", is_instance(str), "a column name or ''"),
    ParamSpec("raw_prediction_col", "the class scores as an ml Vector (for BinaryClassificationEvaluator; '' for "
              "none)", "rawPrediction", is_instance(str), "a column name or ''"),
    ParamSpec("probability_col", "the class probabilities as an ml Vector, when the loss says how to get them "
              "(softmax for CrossEntropyLoss/NLLLoss, sigmoid for BCEWithLogitsLoss; '' for none)", "probability",
              is_instance(str), "a column name or ''"),
    ParamSpec("loss_kinds", "what each output is, from its loss at fit time: 'class_index', 'logits', "
              "'probabilities', 'regression' or 'unknown'", None, optional(lambda v: isinstance(v, list)),
              "a list of strings or None"),
    ParamSpec("input_shapes", "shape of each feature batch (-1: the batch)", None, optional(is_shape_list),
              "a list of shapes or None"),
    ParamSpec("feature_sizes", "values per row of each feature column at fit time; transform checks every batch "
              "against them (None: not checked, as for models saved before 0.3)", None,
              optional(lambda v: isinstance(v, list) and all(is_int(1)(n) for n in v)), "a list of ints >= 1 or None"),
    ParamSpec("output_shapes", "per-row shape of each model output, measured at fit time", None,
              optional(lambda v: isinstance(v, list)), "a list of shapes"),
    ParamSpec("history", "per-epoch training and validation loss and metrics", [],
              lambda v: isinstance(v, list), "a list of dicts"),
    ParamSpec("run_id", "the training run that produced the model", None, optional(is_instance(str)),
              "a string or None"),
    ParamSpec("best_epoch", "the best epoch (1-based) by the estimator's `monitor`, also when restore_best is False",
              None, optional(is_int(1)), "an int >= 1 or None"),
    ParamSpec("use_gpu", "None: a GPU when the executor has one; False: CPU", None,
              optional(lambda v: isinstance(v, bool)), "True, False or None"),
    TOKENIZER,
]
# The param reference's sections (docs/params.md, estimator.core.param_reference), in order: every estimator
# param in exactly one (tests/test_docs.py checks it).
TOPICS = (
    ("The essentials", "What almost every fit sets.",
     ("num_proc", "store", "model", "optimizer", "lr", "loss", "metrics", "feature_cols", "label_cols",
      "batch_size", "epochs", "validation")),
    ("Data", "Columns, shapes, batches and how the rows are read.",
     ("input_shapes", "label_shapes", "sample_weight_col", "drop_nulls", "handle_invalid", "transformation_fn",
      "tokenizer", "max_length", "val_batch_size", "shuffle", "drop_last", "train_steps_per_epoch",
      "validation_steps_per_epoch", "data_mode", "partitions_per_process", "reader", "train_reader_num_workers",
      "val_reader_num_workers", "reader_pool_type", "mp_start_method", "inmemory_cache_all", "shuffle_buffer_size")),
    ("Training", "The loop, the loss, the learning rate and when to stop.",
     ("loss_weights", "loss_constructors", "train_step", "train_fn", "random_seed", "lr_schedule", "warmup_steps",
      "warmup_ratio", "lr_scheduler_fn", "gradient_clip_val", "backward_passes_per_step", "terminate_on_nan",
      "early_stopping_patience", "monitor", "monitor_mode", "min_delta", "restore_best", "callbacks")),
    ("Language models", "Fine-tuning and generation of causal LMs ([Language models](language-models.md)).",
     ("peft_config", "packing", "completion_only_loss", "chat_tools", "objective", "max_new_tokens",
      "generate_kwargs", "generation_batching", "inference_batch_size", "output_kind")),
    ("GPUs and large models", "Devices, precision, sharding and memory ([GPUs and clusters](gpus.md)).",
     ("use_gpu", "backend", "precision", "compile", "strategy", "shard_units", "reshard_after_forward",
      "weights_folder", "gradient_checkpointing", "gradient_compression", "shared_memory_allreduce")),
    ("Tracking and checkpoints", "What a run writes and reports.",
     ("run_id", "verbose", "log_every_n_steps", "mlflow", "checkpoint_steps", "checkpoint_async", "save_top_k")),
    ("Failures", "Retries, lost workers and timeouts ([Failures and recovery](failures.md)).",
     ("max_retries", "min_num_proc", "rendezvous_timeout", "collective_timeout")),
)
# The estimator's training params (batch_size, epochs, lr, ...) stay readable on the model it returns, as Spark's
# models keep their estimator's params (what a CrossValidator picked): the same specs, not repeated.
TRAINING_PARAMS = [s for s in ESTIMATOR_PARAMS if s.json and s.name not in {m.name for m in MODEL_PARAMS}]
MODEL_PARAMS += TRAINING_PARAMS


# Horovod's TorchEstimator params that have no counterpart here, with what to do instead (docs/horovod.md)
HOROVOD_REFUSED = {
    "train_minibatch_fn": "Horovod's per-batch training function is not supported. The loop does what it was "
                          "used for itself: gradient accumulation (backward_passes_per_step), compression "
                          "(gradient_compression) and NaN checks (terminate_on_nan); to change what a step "
                          "computes, pass train_step (docs/training.md, 'Your own training step').",
}
