"""On a GPU every value read back to the host (`.item()`, `float()`, `bool()`, `.tolist()`, `.cpu()`, ...) makes
the host wait for the GPU's queue; inside an epoch the loop reads none (tests/gpu/test_syncs.py counts the syncs
on a GPU). Here, on CPU, every read that our code makes between an epoch's second step and its last but one is
recorded by a TorchFunctionMode on the training thread - the loop, the objectives, the sums, the optimizer step,
with terminate_on_nan's look deferred as on a GPU - and there must be none. A model's own reads (a Hugging Face
model's) are not ours and are not counted."""
import collections
import os
import traceback

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from estimator.launch.local import LocalLauncher
from estimator.train import finite
from estimator.train import loop as loop_module
from helpers import MLP, BlockMLP, make_spec, seeded

READS = {"item", "__float__", "__bool__", "__int__", "__index__", "tolist", "cpu", "numpy"}
PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "estimator") + os.sep


class Reads(TorchFunctionMode):
    """Reads made by this package's own lines (torch's optimizer reads its CPU step counters; a model reads
    what it reads: tests/gpu/test_syncs.py counts every sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ours = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            caller = traceback.extract_stack(limit=2)[0]
            if caller.filename.startswith(PACKAGE):
                self.ours.append(f"{func.__name__} at {caller.filename[len(PACKAGE):]}:{caller.lineno}")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def watch(monkeypatch):
    """The loop's batches watched: the mode on from the second training step to the last but one of each epoch."""
    monkeypatch.setattr(finite, "DEFERRED_CHECK_DEVICES", ("cuda", "cpu"))  # the look deferred, as on a GPU
    state = {"steps": 0, "reads": []}
    original = loop_module.copied_ahead

    def watched(batches, device):
        mode = None
        try:
            for index, (batch, last) in enumerate(original(batches, device)):
                if index == 1 and not last:
                    mode = Reads()
                    mode.__enter__()
                if last and mode is not None:
                    mode.__exit__(None, None, None)
                    state["reads"] += mode.ours
                    mode = None
                elif mode is not None:
                    state["steps"] += 1
                yield batch, last
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)

    monkeypatch.setattr(loop_module, "copied_ahead", watched)
    return state


def spec_for(store, digits, run, model, **fields):
    return make_spec(store, digits, model, torch.optim.AdamW(model.parameters(), lr=0.01), train_rows=640,
                     val_rows=160, batch=32, epochs=1, run=run, **fields)


@pytest.mark.parametrize("case", ["ddp", "weighted-bf16", "fsdp"])
def test_an_epoch_reads_nothing_back_between_its_first_and_last_step(store, digits, watch, case):
    fields = {"ddp": {}, "weighted-bf16": {"precision": "bf16-mixed", "gradient_clip_val": 1.0},
              "fsdp": {"strategy": "fsdp", "shard_alone": True}}[case]
    model = seeded(BlockMLP if case == "fsdp" else MLP)
    (result,) = LocalLauncher().run(spec_for(store, digits, case, model, **fields), 1)
    assert watch["steps"] >= 20 and result.history  # 20 batches a training epoch, 5 of validation
    if case == "fsdp":
        assert "reduce-scatter" in result.allreduce
    assert watch["reads"] == []


def test_a_causal_lm_epoch_tokenized_on_the_rank_reads_nothing_back(store, watch, tmp_path):
    pytest.importorskip("transformers")
    from lm_helpers import color_facts, lm_rows, lm_train_spec, save_pretrained_llama

    path = save_pretrained_llama(str(tmp_path / "tiny"), [p + r for p, r in color_facts()])
    (result,) = LocalLauncher().run(lm_train_spec(store, path, lm_rows(40), batch=4, epochs=1), 1)
    assert watch["steps"] >= 8 and result.history[0]["loss"] > 0
    assert watch["reads"] == []


def test_the_watch_sees_a_read_in_our_code(store, digits, watch, monkeypatch):
    """The checks above can fail: terminate_on_nan's look, not deferred (as on a CPU rank), reads every loss."""
    monkeypatch.setattr(finite, "DEFERRED_CHECK_DEVICES", ("cuda",))
    LocalLauncher().run(spec_for(store, digits, "reading", seeded(MLP)), 1)
    assert watch["steps"] >= 20 and len(watch["reads"]) >= 15  # every watched training step (18) reads
    assert all(read.startswith("__bool__ at train") and "finite.py" in read for read in watch["reads"])


VIEWS = {"detach", "t", "view", "_unsafe_view", "select", "slice", "lift_fresh", "expand", "alias", "unsqueeze",
         "squeeze", "transpose", "permute", "as_strided", "_record_function_enter_new", "_record_function_exit"}


class Launches(TorchDispatchMode):
    """The ops a step dispatches that compute (on a GPU each one is a kernel the host launches; views are not)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def test_a_step_computes_no_more_than_a_hand_written_loop_plus_two_ops(store, digits, monkeypatch):
    """A small model's GPU step waits on the host that launches its kernels. Our step (the built-in loop, the loss
    and its sums on the device, terminate_on_nan deferred as on a GPU) computes what a plain loop that keeps its
    loss sum on the device computes, plus the float64 sum vector's cast and concatenation. Counted as the ops of
    a fit of 40 steps less those of a fit of 20, over 20 steps: what runs once a fit or an epoch cancels out."""
    monkeypatch.setattr(finite, "DEFERRED_CHECK_DEVICES", ("cuda", "cpu"))
    X, y = digits

    def ours(rows):
        model = seeded(MLP)
        spec = make_spec(store, digits, model, torch.optim.AdamW(model.parameters(), lr=0.01), train_rows=rows,
                         val_rows=160, batch=32, epochs=1, run=f"launches-{rows}", metrics=())
        with Launches() as mode:
            LocalLauncher().run(spec, 1)
        return mode.ops

    def plain(rows):
        model = seeded(MLP)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        batches = [(torch.as_tensor(X[i:i + 32]), torch.as_tensor(y[i:i + 32])) for i in range(0, rows, 32)]
        with Launches() as mode:
            total = torch.zeros((), dtype=torch.float64)
            for features, labels in batches:
                optimizer.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(features), labels)
                loss.backward()
                optimizer.step()
                total += loss.detach() * len(labels)
        return mode.ops

    def per_step(run):
        more, fewer = run(1280), run(640)
        more.subtract(fewer)
        return {k: v / 20 for k, v in more.items() if v}

    mine, theirs = per_step(ours), per_step(plain)
    extra = {k: round(v - theirs.get(k, 0), 2) for k, v in mine.items() if v != theirs.get(k, 0)}
    assert sum(mine.values()) <= sum(theirs.values()) + 2, extra
