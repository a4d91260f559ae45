"""The per-rank loop, without Spark: in-process (world size 1) and spawned processes (world size 2)."""
import io

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from estimator.core.faults import Fault, InjectedFault
from estimator.core.pickling import user_objects
from estimator.data.shards import EarlyRead, open_shards
from estimator.failures import RankFailed
from estimator.launch.local import LocalLauncher
from estimator.train.worker import build_optimizer
from helpers import MLP, make_spec, seeded


def _checkpoint(store, run="r"):
    return torch.load(io.BytesIO(store.read_bytes(store.run(run).checkpoint)), weights_only=True)


def test_one_rank_in_process_trains_and_checkpoints(store, digits):
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                 train_rows=1000, val_rows=200, epochs=3)
    (result,) = LocalLauncher().run(spec, 1)
    history = result.history
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert history[-1]["loss"] < history[0]["loss"] and history[-1]["val_accuracy"] > 0.75
    checkpoint = _checkpoint(store)
    assert checkpoint["epoch"] == 3 and set(checkpoint) >= {"model", "optimizer", "history"}
    assert not dist.is_initialized()  # torn down, so the next run in this process works
    (again,) = LocalLauncher().run(spec, 1)
    assert len(again.history) == 3


def test_two_ranks_uneven_shards_report_exact_validation(store, digits):
    """1001 train rows and 151 val rows over 2 ranks: equal steps, no hang, and val metrics that
    equal a direct computation over all val rows with the checkpointed weights."""
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.Adam(model.parameters(), lr=0.01), train_rows=1001,
                 val_rows=151, epochs=2)
    results = LocalLauncher().run(spec, 2)
    assert [r.train_rows for r in results] == [501, 500]
    assert results[0].history == results[1].history  # every rank holds the reduced numbers
    trained = MLP()
    trained.load_state_dict(_checkpoint(store)["model"])
    X, y = digits
    with torch.no_grad():
        logits = trained(torch.from_numpy(X[-151:]))
    expected_loss = nn.CrossEntropyLoss()(logits, torch.from_numpy(y[-151:])).item()
    expected_acc = (logits.argmax(1).numpy() == y[-151:]).mean()
    last = results[0].history[-1]
    assert last["val_loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert last["val_accuracy"] == pytest.approx(expected_acc, abs=1e-9)


def test_a_failing_rank_raises_with_its_traceback_and_leaves_no_group(store, digits):
    def broken_loss(output, target):
        raise ArithmeticError("boom in the loss")

    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=200, val_rows=50,
                 losses=[broken_loss])
    with pytest.raises(RankFailed, match="boom in the loss") as info:
        LocalLauncher().run(spec, 1)
    assert info.value.rank == 0 and "Traceback" in info.value.formatted
    assert not dist.is_initialized()


def test_shards_read_early_are_the_shards_read_at_training_time(store, digits):
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=1001, val_rows=151)
    for rank in (0, 1):
        train, val = EarlyRead(spec, rank, 2).result(rank, 2)
        direct_train, direct_val = open_shards(spec, rank, 2)
        assert (train.rows, val.rows) == (direct_train.rows, direct_val.rows) == ((501, 76) if rank == 0 else (500, 75))
        for early, direct in ((train, direct_train), (val, direct_val)):
            for got, want in zip(early.epoch(1), direct.epoch(1)):  # the same batches, shuffled the same way
                assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)


def test_an_early_read_raises_its_error_on_the_training_thread_and_checks_the_rank(store, digits):
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=300, val_rows=40)
    failing = EarlyRead(spec, 1, 2, (Fault("read", 1, "raise"),))
    with pytest.raises(InjectedFault, match="injected fault at read on rank 1"):
        failing.result(1, 2)
    with pytest.raises(RuntimeError, match="shards read early for rank 0 of 2, but this is rank 1 of 2"):
        EarlyRead(spec, 0, 2).result(1, 2)


def test_optimizer_is_rebuilt_with_groups_hyperparameters_and_state():
    model = seeded(MLP)
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    opt = torch.optim.SGD([{"params": first, "lr": 0.5}, {"params": rest}], lr=0.1, momentum=0.9)
    model(torch.randn(3, 64)).sum().backward()
    opt.step()  # creates momentum buffers
    objs = user_objects(model, opt, [nn.CrossEntropyLoss()], [1.0], [])
    replica = seeded(MLP)
    rebuilt = build_optimizer(objs, replica)
    assert type(rebuilt) is torch.optim.SGD
    assert [g["lr"] for g in rebuilt.param_groups] == [0.5, 0.1]
    assert rebuilt.param_groups[0]["params"][0] is list(replica.parameters())[0]
    original = opt.state[first[0]]["momentum_buffer"]
    np.testing.assert_array_equal(rebuilt.state[list(replica.parameters())[0]]["momentum_buffer"], original)


def test_optimizer_over_another_instance_is_matched_by_position():
    model, other = seeded(MLP), seeded(MLP, seed=1)
    objs = user_objects(model, torch.optim.SGD(other.parameters(), lr=0.3), [nn.MSELoss()], [1.0], [])
    assert objs.optimizer_groups == [[0, 1, 2, 3]]


def test_optimizer_over_an_unrelated_model_is_rejected():
    with pytest.raises(ValueError, match="The 'optimizer' parameter of TorchEstimator must optimize"):
        user_objects(seeded(MLP), torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1), [nn.MSELoss()], [1.0], [])


def test_validation_steps_per_epoch_limits_each_rank_to_its_first_batches(store, digits):
    """validation_steps_per_epoch=1, val_batch_size=10: each rank validates its first 10 rows only
    (rank 0 holds val rows 0..75, rank 1 rows 76..150), and the reported loss is exact over those 20."""
    import dataclasses

    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.0), train_rows=300,
                     val_rows=151, epochs=1, validation_steps_per_epoch=1)
    spec = dataclasses.replace(spec, val_batch_size=10)
    history = LocalLauncher().run(spec, 2)[0].history
    X, y = digits
    rows = np.r_[np.arange(10), 76 + np.arange(10)]
    with torch.no_grad():
        expected = nn.CrossEntropyLoss()(model(torch.from_numpy(X[-151:][rows])), torch.from_numpy(y[-151:][rows]))
    assert history[0]["val_loss"] == pytest.approx(expected.item(), rel=1e-5)


def test_train_steps_per_epoch_sets_the_optimizer_steps(store, digits):
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.Adam(model.parameters(), lr=0.01), train_rows=300,
                     val_rows=50, epochs=3, train_steps_per_epoch=7)
    assert LocalLauncher().run(spec, 1)[0].optimizer_steps == 21


def test_label_shapes_reshape_labels_and_name_a_mismatch():
    from estimator.core.spec import DataSpec
    from estimator.data.arrays import to_tensors

    data = DataSpec(None, (), (), ("x",), ("y",), label_shapes=((-1, 2, 2),))
    batch = {"x": np.zeros((3, 5), np.float32), "y": np.arange(12, dtype=np.float32).reshape(3, 4)}
    _, (labels,), _ = to_tensors(batch, data)
    assert labels.shape == (3, 2, 2)
    bad = DataSpec(None, (), (), ("x",), ("y",), label_shapes=((-1, 3),))
    with pytest.raises(ValueError, match=r"Column 'y' has 4 values per row, but its shape \[-1, 3\] needs 3"):
        to_tensors(batch, bad)


@pytest.mark.parametrize("layout, global_steps", [([64, 1, 1, 1, 0], 3 + 2), ([64, 1], 3 + 2), ([32, 1, 1, 1, 0], 3 + 4),
                                                   ([32, 1, 0, 1, 0], 3 + 4), ([32, 1, 0, 0, 0], 3 + 5),
                                                   ([32, 1, 1], 3 + 5), ([32, 1, 1, 1, 4], 3 + 1)])
def test_a_step_checkpoint_resumes_at_its_batch_or_over_the_rows_left(store, digits, caplog, layout, global_steps):
    """300 rows, batch 64, in memory: 5 steps an epoch. A checkpoint 3 steps into epoch 1 of the same layout
    (or of a version that did not record the reader) resumes at batch 3 (2 steps left); one of batch 32, read in
    memory or streamed, leaves 300 - 96 rows: 4 steps of 64 (estimator.data.remainder); one of epochs of 4 batches
    (train_steps_per_epoch) leaves 32 draws of its plan: 1 step; one whose order cannot be replayed (petastorm's,
    say), or from a version that did not record whether it can, starts the epoch over (5 steps), and says so."""
    import dataclasses
    import logging

    from estimator.train.checkpoint import Position, save_checkpoint

    model = seeded(MLP)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = make_spec(store, digits, model, optimizer, train_rows=300, val_rows=50, epochs=1)
    save_checkpoint(store, spec.run.checkpoint, model, optimizer, [], Position(0, 3, [0.0] * 4, 3, layout))
    with caplog.at_level(logging.WARNING, logger="estimator"):
        LocalLauncher().run(dataclasses.replace(spec, resume_from=spec.run.checkpoint), 1)
    assert _checkpoint(store)["global_step"] == global_steps
    assert ("the epoch starts over from its first batch" in caplog.text) == (global_steps == 3 + 5)


def test_a_checkpoint_inside_an_epoch_keeps_its_sums_by_name_and_0_3_0_dev0s_list_still_resumes(store, digits):
    """300 rows of batch 32, a checkpoint every 4 steps; the run fails at step 6, after the checkpoint of step 4.
    The checkpoint holds the epoch's sums so far by name; resumed from it, or from the same checkpoint with the
    sums as 0.3.0.dev0 wrote them (a list in the objective's order), the epoch reports what the uninterrupted run
    reports. Sums of another layout (another metric) are refused by name, not added to the wrong slots."""
    import dataclasses

    from estimator.train.checkpoint import load_checkpoint, write_checkpoint

    def run_spec(run, **fields):
        model = seeded(MLP)
        return make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=300,
                         val_rows=50, epochs=1, batch=32, run=run, checkpoint_steps=4, **fields)

    (whole,) = LocalLauncher().run(run_spec("whole"), 1)
    cut = run_spec("cut")
    with pytest.raises(RankFailed):
        LocalLauncher(faults=(Fault("step", 0, "raise", step=6),)).run(cut, 1)
    state = load_checkpoint(store, cut.run.checkpoint)
    assert state["position"]["step"] == 4 and list(state["position"]["sums"]) == [
        "loss", "loss_weight", "rows", "metric:accuracy"]
    assert state["position"]["sums"]["rows"] == 4 * 32
    named = state["position"]["sums"]
    for saved in (named, list(named.values()), {**named, "metric:recall": 0.0}):
        write_checkpoint(store, {**state, "position": {**state["position"], "sums": saved}}, [cut.run.checkpoint])
        again = dataclasses.replace(cut, resume_from=cut.run.checkpoint, launch_id=f"again-{len(saved)}")
        if len(saved) > len(named):
            with pytest.raises(RankFailed, match=r"whose sums are \['loss', 'loss_weight', 'metric:accuracy', "
                                                 r"'metric:recall', 'rows'\].*same loss and metrics"):
                LocalLauncher().run(again, 1)
            continue
        (resumed,) = LocalLauncher().run(again, 1)
        assert {k: v for k, v in resumed.history[0].items() if k != "data_wait"} == pytest.approx(
            {k: v for k, v in whole.history[0].items() if k != "data_wait"}, rel=1e-12)


def test_the_memory_budget_comes_from_pyspark_memory_per_executor_core():
    from estimator.estimator import pyspark_memory_per_task

    class Conf(dict):
        def get(self, key, default=None):
            return super().get(key, default)

    class Session:
        def __init__(self, **conf):
            self.conf = Conf({k.replace("_", "."): v for k, v in conf.items()})

    assert pyspark_memory_per_task(Session()) is None
    assert pyspark_memory_per_task(Session(spark_executor_pyspark_memory="4g", spark_executor_cores="4")) == 1024
    assert pyspark_memory_per_task(Session(spark_executor_pyspark_memory="512m")) == 512
    assert pyspark_memory_per_task(Session(spark_executor_pyspark_memory="2048")) == 2048  # Spark's unit: MiB


def test_gradient_clip_val_bounds_the_global_norm_of_every_step(store, digits, tmp_path):
    from helpers import RecordingSGD

    def norms(**fields):
        RecordingSGD.path = str(tmp_path / f"norms-{len(fields)}.txt")
        model = seeded(MLP)
        spec = make_spec(store, digits, model, RecordingSGD(model.parameters(), lr=0.5), train_rows=600,
                         val_rows=100, epochs=1, run=f"clip-{len(fields)}", **fields)
        LocalLauncher().run(spec, 1)
        return [float(line) for line in open(RecordingSGD.path)]

    free = norms()
    assert len(free) == 10 and max(free) > 0.05  # the premise: unclipped steps exceed the bound
    clipped = norms(gradient_clip_val=0.05)
    assert len(clipped) == 10 and max(clipped) <= 0.05 * (1 + 1e-5)


def test_16_mixed_precision_on_a_cpu_rank_is_refused_with_what_to_use(store, digits):
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=200, val_rows=50,
                     precision="16-mixed")
    with pytest.raises(RankFailed, match=r"precision='16-mixed' needs CUDA .* Use precision='bf16-mixed' on CPUs"):
        LocalLauncher().run(spec, 1)


def test_bf16_mixed_precision_trains_under_autocast_on_cpu(store, digits):
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                     train_rows=1000, val_rows=200, epochs=3, precision="bf16-mixed")
    history = LocalLauncher().run(spec, 1)[0].history
    assert history[-1]["val_accuracy"] > 0.75 and history[-1]["loss"] < history[0]["loss"]


def test_a_resumed_16_mixed_run_continues_the_grad_scalers_scale(store, digits, monkeypatch):
    """The checkpoint holds the GradScaler's state and a resume loads it. Run here on CPU (torch has a CPU
    GradScaler; the estimator allows 16-mixed on CUDA only): the checkpoint of epoch 1 is edited to a scale of
    1024 that grows at the next step; the resumed epoch must grow it to 2048, where a fresh scaler would start at
    65536 and a fresh growth count would not grow it at all."""
    import dataclasses

    from estimator.train.checkpoint import Position, load_checkpoint, save_checkpoint

    from estimator.train.precision import F16Mixed

    monkeypatch.setattr(F16Mixed, "devices", ("cuda", "cpu"))
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.05), train_rows=320, val_rows=64,
                     epochs=1, batch=64, precision="16-mixed")
    LocalLauncher().run(spec, 1)
    state = load_checkpoint(store, spec.run.checkpoint)
    assert state["grad_scaler"]["growth_interval"] == 2000 and state["grad_scaler"]["scale"] > 0
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict({**state["grad_scaler"], "scale": 1024.0, "_growth_tracker": 1999})
    model.load_state_dict(state["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    optimizer.load_state_dict(state["optimizer"])
    save_checkpoint(store, spec.run.checkpoint, model, optimizer, state["history"], Position(1, global_step=5),
                    scaler=scaler)
    LocalLauncher().run(dataclasses.replace(spec, epochs=2, resume_from=spec.run.checkpoint), 1)
    resumed = load_checkpoint(store, spec.run.checkpoint)["grad_scaler"]
    assert resumed["scale"] == 2048.0 and resumed["_growth_tracker"] == 4, resumed  # 5 steps, no overflow


class LossTurnsNaN:
    """A loss that is NaN from its `at`-th training batch on (1-based; validation batches do not count), the cross
    entropy before."""

    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self, output, target):
        self.calls += torch.is_grad_enabled()
        loss = nn.functional.cross_entropy(output, target)
        return loss * float("nan") if self.calls >= self.at else loss


@pytest.mark.parametrize("deferred", [False, True], ids=["every-step", "deferred-as-on-gpus"])
def test_a_nan_loss_fails_the_rank_before_its_weights_are_checkpointed(store, digits, monkeypatch, deferred):
    """terminate_on_nan is on by default. Epoch 1 is good and checkpointed; epoch 2's loss turns NaN at its 3rd
    step: the rank fails with NonFiniteLoss naming epoch 2, step 3 and the rank, and the checkpoint still holds
    epoch 1's (finite) weights. Deferred (GPUs: no host wait per step) finds the same step at the epoch's end."""
    from estimator.failures import FailureKind
    from estimator.train import finite

    if deferred:
        monkeypatch.setattr(finite, "DEFERRED_CHECK_DEVICES", ("cuda", "cpu"))
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=320, val_rows=64,
                     epochs=2, batch=64, losses=[LossTurnsNaN(at=5 + 3)])  # 5 steps an epoch
    with pytest.raises(RankFailed) as info:
        LocalLauncher().run(spec, 1)
    assert info.value.kind is FailureKind.NAN
    assert info.value.summary.startswith("NonFiniteLoss: The training loss is nan at epoch 2, step 3 on rank 0")
    assert "terminate_on_nan=True (the default)" in info.value.summary and "lower lr" in info.value.summary
    state = _checkpoint(store)
    assert state["epoch"] == 1 and len(state["history"]) == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values())


class OverflowingSGD(torch.optim.SGD):
    """SGD whose 5th step leaves an infinite weight while every loss computed before it is finite."""

    def step(self, closure=None):
        result = super().step(closure)
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 5:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return result


def test_weights_that_overflow_at_an_epochs_last_step_are_not_checkpointed(store, digits):
    model = seeded(MLP)
    spec = make_spec(store, digits, model, OverflowingSGD(model.parameters(), lr=0.1), train_rows=320, val_rows=0,
                     epochs=1, batch=64)
    with pytest.raises(RankFailed, match=r"NonFiniteLoss: The model's weights are not finite at epoch 1 on rank 0 "
                                         r"\(parameters net.0.weight\)"):
        LocalLauncher().run(spec, 1)
    assert not store.exists(spec.run.checkpoint)


def test_terminate_on_nan_false_trains_on(store, digits):
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=320, val_rows=64,
                     epochs=2, batch=64, losses=[LossTurnsNaN(at=3)], terminate_on_nan=False)
    (result,) = LocalLauncher().run(spec, 1)
    assert [np.isnan(row["loss"]) for row in result.history] == [True, True]


def test_one_rank_trains_through_a_stand_in_with_ddps_calls_and_the_same_numbers(store, digits):
    """One rank has no gradients to average: it trains through `Solo`, not DistributedDataParallel (whose hooks
    cost 27% of a small model's steps on an H100), with the calls a train_step or train_fn makes of DDP."""
    from estimator.train.distributed import RankContext
    from estimator.train.strategies.ddp import DDP, SOLO, Solo

    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=320, val_rows=64,
                     epochs=1, batch=64)
    module = seeded(MLP)
    solo = DDP("ddp", spec, RankContext(0, 1, 0, "cpu"), None).wrap(module)
    assert isinstance(solo, Solo) and solo.module is module
    x = torch.from_numpy(digits[0][:8])
    with solo.no_sync():
        assert torch.equal(solo(x), module(x))
    assert list(solo.parameters()) == list(module.parameters())
    (result,) = LocalLauncher().run(spec, 1)
    assert result.allreduce == SOLO


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_lr_scheduler_fn_in_lightnings_dict_form_steps_per_step_or_per_epoch(store, digits, interval):
    """lr_scheduler_fn may return a scheduler (stepped per epoch) or {'scheduler': ..., 'interval': 'step'}
    (stepped after every optimizer step): 320 rows of batch 64 are 5 steps an epoch, 10 in 2 epochs."""
    import dataclasses
    import pickle

    from estimator.core.pickling import dumps

    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.Adam(model.parameters(), lr=0.1), train_rows=320,
                     val_rows=64, epochs=2, batch=64)
    objs = pickle.loads(spec.payload)
    halving = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)  # noqa: E731
    objs = dataclasses.replace(objs, lr_scheduler_fn=(lambda opt: {"scheduler": halving(opt), "interval": "step"})
                               if interval == "step" else halving)
    (result,) = LocalLauncher().run(dataclasses.replace(spec, payload=dumps(objs, "model", roots=[objs.model])), 1)
    assert result.optimizer_steps == 10
    steps = 10 if interval == "step" else 2
    assert _checkpoint(store)["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.1 * 0.5 ** steps)


def test_every_precision_the_param_allows_has_its_object_and_no_other():
    """The precision param (core/param_table, below train/) lists its values by hand; each is a class in
    estimator.train.precision.PRECISIONS, which the loop, DPO's reference pass and FSDP's sharding ask."""
    from estimator.core.param_table import ESTIMATOR_PARAMS
    from estimator.train.precision import PRECISIONS, BF16Mixed, F16Mixed, Precision

    spec = next(s for s in ESTIMATOR_PARAMS if s.name == "precision")
    assert all(spec.check(name) for name in PRECISIONS) and not spec.check("bf16")
    assert all(f"'{name}'" in spec.allowed for name in PRECISIONS)
    cpu = torch.device("cpu")
    assert [type(PRECISIONS[name](cpu)) for name in ("32", "bf16-mixed")] == [Precision, BF16Mixed]
    with pytest.raises(ValueError, match="precision='16-mixed' needs CUDA .* rank 3 trains on cpu"):
        F16Mixed(cpu, rank=3)
    with BF16Mixed(cpu).autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with Precision(cpu).autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert BF16Mixed.fsdp_policy().param_dtype == torch.bfloat16 and Precision.fsdp_policy().param_dtype is None
