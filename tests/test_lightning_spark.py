"""model= a LightningModule: its configure_optimizers, training_step, validation_step (self.log) run in the
estimator's loop on 2 ranks. It trains digits, transforms, saves and loads in a Pipeline; a module whose steps
compute what the built-in loop computes trains its exact weights and history (the same loop); what the estimator
cannot honour is refused on the driver."""
import json

import pytest
import torch
import torch.nn.functional as F
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from torch import nn

from estimator import TorchEstimator, TorchModel
from helpers import MLP, metrics, seeded
from spark_helpers import digits_frame, jobs_run_by

L = pytest.importorskip("lightning")
pytestmark = pytest.mark.spark


class LitBuiltIn(L.LightningModule):
    """An ordinary Lightning 2.x module (`x, y = batch`, self.log, self.log_dict), computing what the built-in loop
    computes with loss=CrossEntropyLoss(), metrics=['accuracy'] and Adam(lr=0.01)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("accuracy", (logits.argmax(1) == y).float().mean(), prog_bar=True)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log_dict({"val_loss": F.cross_entropy(logits, y), "val_accuracy": (logits.argmax(1) == y).float().mean()})

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class LitDigits(LitBuiltIn):
    """The same steps, also logging self.current_epoch, and a scheduler that reads self.trainer.max_epochs."""

    def training_step(self, batch, batch_idx):
        self.log("epoch_seen", float(self.current_epoch))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.max_epochs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}


def seeded_lit(cls=None):
    """A module with MLP's seeded weights."""
    module = (cls or LitDigits)()
    module.net.load_state_dict(seeded(MLP).net.state_dict())
    return module


def _est(store, model=None, **kw):
    params = dict(num_proc=2, store=store, model=model if model is not None else seeded_lit(),
                  feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=6, validation=0.2,
                  random_seed=5)
    params.update(kw)
    return TorchEstimator(**params)


def test_a_lightning_module_trains_digits_transforms_and_saves_and_loads_in_a_pipeline(spark, store, digits,
                                                                                       tmp_path):
    train, test = digits_frame(spark, digits).randomSplit([0.8, 0.2], seed=3)
    fitted = Pipeline(stages=[_est(store, loss=nn.CrossEntropyLoss())]).fit(train)  # loss: what outputs are
    model = fitted.stages[-1]
    history = model.getHistory()
    assert set(history[-1]) == {"epoch", "loss", "accuracy", "epoch_seen", "val_loss", "val_accuracy", "data_wait"}
    assert [row["epoch_seen"] for row in history] == [0, 1, 2, 3, 4, 5]  # self.current_epoch, as Lightning counts
    assert history[-1]["val_accuracy"] >= 0.90 and history[-1]["loss"] < history[0]["loss"]
    assert model.getOptimizer().param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-9)  # cosine over max_epochs=6
    evaluator = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy")
    accuracy = evaluator.evaluate(fitted.transform(test))  # forward(x) on the executors
    assert accuracy >= 0.90
    # loss=CrossEntropyLoss() said the outputs are class scores: probability (softmax), so logLoss works
    log_loss = MulticlassClassificationEvaluator(labelCol="label", metricName="logLoss").evaluate(
        fitted.transform(test))
    assert 0 < log_loss < 0.5
    path = str(tmp_path / "pipeline")
    fitted.write().overwrite().save(path)
    reloaded = PipelineModel.load(path)
    assert isinstance(reloaded.stages[-1], TorchModel) and isinstance(reloaded.stages[-1].getModel(), LitDigits)
    assert evaluator.evaluate(reloaded.transform(test)) == pytest.approx(accuracy)


def test_a_lightning_module_computing_the_built_in_loss_trains_the_built_in_loops_weights(spark, store, digits,
                                                                                         monkeypatch):
    df = digits_frame(spark, digits)
    plain = seeded(MLP)
    built_in = _est(store, model=plain, optimizer=torch.optim.Adam(plain.parameters(), lr=0.01),
                    loss=nn.CrossEntropyLoss(), metrics=["accuracy"], epochs=2, run_id="built-in").fit(df)
    lit = _est(store, model=seeded_lit(LitBuiltIn), epochs=2, run_id="lightning").fit(df)
    for a, b in zip(lit.getModel().state_dict().values(), built_in.getModel().state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
    assert [set(row) for row in lit.getHistory()] == [set(row) for row in built_in.getHistory()]
    for x, y in zip(lit.getHistory(), built_in.getHistory()):  # every metric exact over rows, on 2 ranks
        assert metrics(x) == pytest.approx(metrics(y), rel=1e-6)
    # a rank killed inside epoch 2 (23 batches an epoch): retried from the checkpoint of batch 30, it ends as if
    # never interrupted, its logged keys' sums of the epoch's first batches restored too
    monkeypatch.setenv("SPARK_TORCH_ESTIMATOR_FAULTS", json.dumps([{"point": "step", "rank": 1, "action": "exit",
                                                                    "step": 36, "attempt": 0}]))
    killed = _est(store, model=seeded_lit(LitBuiltIn), epochs=2, run_id="lightning-killed", checkpoint_steps=10,
                  max_retries=1).fit(df)
    monkeypatch.delenv("SPARK_TORCH_ESTIMATOR_FAULTS")
    for a, b in zip(killed.getModel().state_dict().values(), lit.getModel().state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
    for x, y in zip(killed.getHistory(), lit.getHistory()):
        assert metrics(x) == pytest.approx(metrics(y), rel=1e-6)


class TwoOptimizers(LitBuiltIn):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


class Manual(LitBuiltIn):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class AsksTheTrainer(LitBuiltIn):
    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1]) * self.trainer.accumulate_grad_batches


class LogsAMax(LitBuiltIn):
    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("worst", loss, reduce_fx="max")
        return loss


class SameKeyTwice(LitBuiltIn):
    def validation_step(self, batch, batch_idx):
        self.log("accuracy", (self(batch[0]).argmax(1) == batch[1]).float().mean())


class OtherHooks(LitBuiltIn):
    def on_train_epoch_end(self):
        pass


@pytest.mark.parametrize("model, match", [
    (TwoOptimizers(), r"returned a list of 2 \(SGD, SGD\): TorchEstimator trains a LightningModule with exactly one"),
    (Manual(), r"automatic_optimization = False .*train_fn"),
    (AsksTheTrainer(), r"self.trainer.accumulate_grad_batches: .* not in a Lightning Trainer; self.trainer has "),
    (LogsAMax(), r"self.log\('worst', ..., reduce_fx='max'\) in training_step"),
    (SameKeyTwice(), r"logs \['accuracy'\]: .*Name validation's keys apart"),
])
def test_what_a_lightning_module_asks_and_the_estimator_cannot_honour_is_refused_before_training(spark, store,
                                                                                                 digits, model, match):
    with pytest.raises(ValueError, match=match):
        _est(store, model=model, epochs=1).fit(digits_frame(spark, digits))


def test_params_a_lightning_module_brings_itself_are_refused_before_any_job_and_skipped_hooks_named(spark, store,
                                                                                                    digits):
    df = digits_frame(spark, digits)
    module = LitBuiltIn()
    for extra, match in [(dict(optimizer=torch.optim.SGD(module.parameters(), lr=0.1)), "takes no optimizer"),
                         (dict(lr=0.1), "takes no lr .*configure_optimizers")]:
        def fit():
            with pytest.raises(ValueError, match=match):
                _est(store, model=module, **extra).fit(df)

        assert jobs_run_by(spark, fit) == []
    with pytest.warns(UserWarning, match="not these hooks it overrides: on_train_epoch_end"):
        history = _est(store, model=OtherHooks(), epochs=1).fit(df).getHistory()
    assert len(history) == 1


class StepsOnly(L.LightningModule):  # no forward(), as lightning.pytorch.demos' LightningLSTM: a Trainer needs none
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(64, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WithPredictStep(StepsOnly):
    def predict_step(self, batch, batch_idx):
        return self.net(batch)


def test_lightnings_own_demo_modules_train_unmodified(spark, store, digits):
    """BoringModel: one feature column, no label_cols, the batch is that tensor; transform gives `output` (no
    prediction columns without labels). A module without forward() trains; transform uses its predict_step, and
    one with neither is refused by name."""
    import numpy as np
    from lightning.pytorch.demos.boring_classes import BoringModel

    rng = np.random.default_rng(0)
    df = spark.createDataFrame([(rng.standard_normal(32).astype(np.float32).tolist(),) for _ in range(200)],
                               "x array<float>")
    torch.manual_seed(0)
    boring = TorchEstimator(num_proc=2, store=store, model=BoringModel(), feature_cols=["x"], batch_size=16,
                            epochs=2).fit(df)
    assert [row["epoch"] for row in boring.getHistory()] == [1, 2] and boring.getLabelCols() == []
    out = boring.transform(df)
    assert out.columns == ["x", "output"] and len(out.first()["output"]) == 2
    digits = digits_frame(spark, digits).limit(300)
    predicted = _est(store, model=WithPredictStep(), epochs=1, validation=None).fit(digits).transform(digits)
    assert "prediction" in predicted.columns and len(predicted.first()["label__output"]) == 10
    steps_only = _est(store, model=StepsOnly(), epochs=1, validation=None).fit(digits)  # trains without forward
    with pytest.raises(ValueError, match=r"StepsOnly has no forward\(\) and no predict_step\(\): "
                                         r"TorchModel.transform calls one of them"):
        steps_only.transform(digits)


class OneCycle(LitBuiltIn):
    """The Lightning docs' idiom: OneCycleLR over self.trainer.estimated_stepping_batches, stepped every step,
    with self.optimizers() and self.lr_schedulers() read in training_step."""

    def training_step(self, batch, batch_idx):
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        assert self.lr_schedulers() is not None
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5,
                                                    total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}


def test_a_per_step_one_cycle_schedule_runs_its_whole_cycle(spark, store, digits):
    """2 ranks, 3 epochs, accumulation of 2, drop_last: estimated_stepping_batches counts the run's optimizer steps
    exactly (1797 rows: 899 a rank, 28 full batches of 32, 14 steps an epoch, 42 in all; OneCycleLR refuses a step
    past its total), the rate rises then falls, and ends where OneCycleLR stepped 42 times ends (per epoch it
    would have stepped 3 times: near max_lr / 25)."""
    df = digits_frame(spark, digits)
    model = _est(store, model=seeded_lit(OneCycle), epochs=3, backward_passes_per_step=2, drop_last=True,
                 validation=None).fit(df)
    rates = [row["lr"] for row in model.getHistory()]
    assert rates[0] < rates[1] and rates[2] < rates[1]  # each epoch's mean rate: up, then down
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    cycle = torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.5, total_steps=42)
    for _ in range(42):
        sgd.step()
        cycle.step()
    assert model.getOptimizer().param_groups[0]["lr"] == pytest.approx(sgd.param_groups[0]["lr"], rel=1e-6)
    assert model.getHistory()[-1]["accuracy"] > 0.8
