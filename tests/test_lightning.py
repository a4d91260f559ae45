"""estimator.train.lightning without Spark: the forms of configure_optimizers taken and refused, self.log's capture,
the stand-in trainer, the hooks named as not called, and the sums a LightningObjective reduces."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from estimator.core import lightning_module
from estimator.train import lightning
from estimator.train.objectives.lightning import LightningObjective
from estimator.train.steps import StepContext
from estimator.train.sums import split

L = pytest.importorskip("lightning")


class Lit(L.LightningModule):
    def __init__(self, configure=None):
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.configure = configure

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_ce", loss)
        if batch_idx % 2 == 0:
            self.log_dict({"even": 1.0})
        return {"loss": loss}

    def validation_step(self, batch):  # Lightning 2.x lets batch_idx out
        x, y = batch
        self.log("val_ce", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return self.configure(self)


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1)


@pytest.mark.parametrize("configure, scheduled, monitor", [
    (sgd, False, None),
    (lambda m: [sgd(m)], False, None),
    (lambda m: ([o := sgd(m)], [torch.optim.lr_scheduler.StepLR(o, 1)]), True, None),
    (lambda m: {"optimizer": (o := sgd(m)), "lr_scheduler": torch.optim.lr_scheduler.StepLR(o, 1)}, True, None),
    (lambda m: [{"optimizer": (o := sgd(m)), "lr_scheduler": {
        "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(o), "monitor": "val_ce"}}], True, "val_ce"),
    (lambda m: {"optimizer": (o := sgd(m)), "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.1, total_steps=m.trainer.estimated_stepping_batches), "interval": "step"}}, True, None),
])
def test_configure_optimizers_forms_with_one_optimizer_are_taken(configure, scheduled, monitor):
    module = Lit(configure)
    trainer = lightning.attach(module, lightning.StandInTrainer(0, 1, 0, 3, estimated_stepping_batches=30))
    optimizer, scheduler, named, interval = lightning.optimizers_of(module)
    assert isinstance(optimizer, torch.optim.SGD) and (scheduler is not None) == scheduled and named == monitor
    assert interval == ("step" if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR) else "epoch")
    assert module.optimizers() is optimizer and module.lr_schedulers() is scheduler  # Lightning's own accessors
    assert trainer.optimizers == [optimizer]


@pytest.mark.parametrize("configure, match", [
    (lambda m: None, r"returned None: TorchEstimator trains a LightningModule with exactly one"),
    (lambda m: (sgd(m), sgd(m)), r"a tuple of 2 \(SGD, SGD\)"),
    (lambda m: {"optimizer": (o := sgd(m)), "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(o, 1),
                                                            "interval": "step", "frequency": 2}}, r"frequency=2"),
    (lambda m: {"optimizer": (o := sgd(m)), "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(o)},
     r"ReduceLROnPlateau without 'monitor'"),
])
def test_configure_optimizers_forms_the_loop_cannot_honour_are_refused_by_name(configure, match):
    with pytest.raises(ValueError, match=match):
        lightning.optimizers_of(Lit(configure))


def test_detection_and_the_hooks_named_as_not_called():
    class Hooked(Lit):
        def on_validation_epoch_end(self):
            pass

        def setup(self, stage):
            pass

    module = lightning_module
    assert module.is_lightning_module(Lit(sgd)) and not module.is_lightning_module(nn.Linear(2, 2))
    assert lightning.hooks_not_called(Lit(sgd)) == []
    assert lightning.hooks_not_called(Hooked(sgd)) == ["on_validation_epoch_end", "setup"]
    assert module.overrides(Lit(sgd), "validation_step") and not module.overrides(Lit(sgd), "test_step")


def test_the_stand_in_trainer_answers_epochs_steps_and_ranks_and_refuses_the_rest_by_name():
    module = Lit(sgd)
    trainer = lightning.attach(module, lightning.StandInTrainer(1, 4, 0, 7))
    trainer.update(StepContext(1, 4, torch.device("cpu"), 3, True, batch_idx=5, global_step=42))
    assert (module.current_epoch, module.global_step, module.global_rank, module.trainer.max_epochs) == (2, 42, 1, 7)
    assert not module.trainer.is_global_zero
    with pytest.raises(AttributeError, match=r"self.trainer.datamodule: .*not in a Lightning Trainer; self.trainer "
                                             r"has .*current_epoch"):
        module.trainer.datamodule
    assert "_trainer" not in {k for k, v in module.__getstate__().items() if v is not None}  # not pickled


def test_self_log_is_captured_per_hook_call_and_refuses_what_it_cannot_average():
    module = Lit(sgd)
    with lightning.logging_into(module, "training_step") as logged:
        module.log("a", torch.tensor([2.0], requires_grad=True))
        module.log_dict({"b": 3, "c": torch.tensor(0.5)})
    assert {k: float(v) for k, v in logged.values.items()} == {"a": 2.0, "b": 3.0, "c": 0.5}
    assert "log" not in vars(module)  # Lightning's own log is back
    with lightning.logging_into(module, "training_step"):
        with pytest.raises(ValueError, match=r"self.log\('m', <Tensor of shape \(3,\)>\) in training_step"):
            module.log("m", torch.ones(3))
        with pytest.raises(ValueError, match=r"reduce_fx='sum'"):
            module.log("s", 1.0, reduce_fx="sum")


def test_a_lightning_objective_sums_the_loss_and_each_logged_key_over_the_rows_that_logged_it():
    module = Lit(sgd)
    trainer = lightning.attach(module, lightning.StandInTrainer(0, 1, 0, 1))
    objective = LightningObjective(module, ["train_ce", "even"], ["val_ce"], trainer)
    steps = lightning.LightningSteps(module)
    torch.manual_seed(0)
    batches = [(torch.randn(n, 4), torch.randint(0, 3, (n,))) for n in (4, 6, 2)]
    train = torch.zeros(objective.layout.width, dtype=torch.float64)
    val = torch.zeros(objective.layout.width, dtype=torch.float64)
    for index, (x, y) in enumerate(batches):
        ctx = StepContext(0, 1, torch.device("cpu"), 1, True, batch_idx=index)
        train += objective.on_batch(steps, ([x], [y], None), ctx)[1]
        with torch.no_grad():
            val += objective.on_batch(module, ([x], [y], None), StepContext(0, 1, torch.device("cpu"), 1, False,
                                                                            batch_idx=index))[1]
    row = objective.summarize(*split(objective.layout, torch.cat([train, val]).tolist(), with_val=True))
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    with torch.no_grad():
        whole = float(F.cross_entropy(module(x), y))
    assert row["loss"] == pytest.approx(whole) and row["train_ce"] == pytest.approx(whole)
    assert row["val_ce"] == pytest.approx(whole) and row["even"] == 1.0  # logged by batches 0 and 2 only
    assert set(row) == {"loss", "train_ce", "even", "val_ce"}
    with pytest.raises(ValueError, match=r"training_step logged 'surprise' .*not log on the driver's dry run"):
        module.training_step = lambda batch, batch_idx: (module.log("surprise", 1.0), torch.ones(()))[1]
        objective.on_batch(steps, ([x], [y], None), StepContext(0, 1, torch.device("cpu"), 1, True))
