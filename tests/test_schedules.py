"""lr_schedule with warmup_steps / warmup_ratio (estimator.train.schedules): the rate after every optimizer step is
Hugging Face's get_*_schedule_with_warmup's (TRL's), the history's 'lr' is the rate at each epoch's end, a run cut
inside an epoch and resumed steps the schedule as the uninterrupted run does (the same weights, the same rates),
and what would set the rate twice is refused by name before any job. No Spark (LocalLauncher)."""
import math

import pytest
import torch

from estimator.core.faults import Fault
from estimator.failures import RankFailed
from estimator.launch.local import LocalLauncher
from estimator.train.checkpoint import load_checkpoint
from estimator.train.schedules import WarmupSchedule, built_in_schedule
from helpers import MLP, make_spec, seeded

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_each_schedules_rate_is_hugging_faces_at_every_step(kind):
    total, warmup = 23, 5
    ours_opt, theirs_opt = (torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3) for _ in range(2))
    ours = built_in_schedule(ours_opt, kind, warmup, None, total)
    theirs = {"constant": lambda o: transformers.get_constant_schedule_with_warmup(o, warmup),
              "linear": lambda o: transformers.get_linear_schedule_with_warmup(o, warmup, total),
              "cosine": lambda o: transformers.get_cosine_schedule_with_warmup(o, warmup, total)}[kind](theirs_opt)
    rates = []
    for _ in range(total):
        rates.append((ours_opt.param_groups[0]["lr"], theirs_opt.param_groups[0]["lr"]))
        ours_opt.step(), theirs_opt.step(), ours.step(), theirs.step()
    assert all(a == pytest.approx(b, abs=1e-12) for a, b in rates), rates
    assert rates[0][0] == 0.0 and rates[warmup][0] == pytest.approx(0.3)  # from 0, the full rate after the warmup
    if kind != "constant":
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # 0 at the run's last step


def test_warmup_ratio_is_a_fraction_of_the_run_rounded_up_and_a_warmup_alone_is_constant_after_it():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = built_in_schedule(opt, None, None, 0.1, 25)
    assert schedule.lr_lambdas[0] == WarmupSchedule("constant", 3, 25)
    assert built_in_schedule(opt, None, None, None, 25) is None and built_in_schedule(opt, None, 0, 0.0, 25) is None


def spec(store, digits, run, **fields):
    model = seeded(MLP)
    return make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.2), train_rows=600, val_rows=100,
                     batch=64, epochs=3, run=run, lr_schedule="cosine", warmup_steps=4, **fields)


def trained(store, run):
    state = load_checkpoint(store, store.run(run).checkpoint)
    return state["model"], state["history"], state["lr_scheduler"]


def test_a_cosine_run_reports_its_rate_and_resumed_inside_an_epoch_goes_on_as_if_uninterrupted(store, digits):
    """600 rows in batches of 64: 10 steps an epoch, 30 in the run. Cut before step 7 of the first epoch (past
    the warmup; its checkpoint at step 6), then continued: the weights and every epoch's rate are the
    uninterrupted run's."""
    from dataclasses import replace

    (whole,) = LocalLauncher().run(spec(store, digits, "whole"), 1)
    factor = WarmupSchedule("cosine", 4, 30)
    assert [row["lr"] for row in whole.history] == pytest.approx([0.2 * factor(10 * e) for e in (1, 2, 3)])
    assert whole.history[-1]["lr"] == pytest.approx(0.0, abs=1e-12) and whole.history[0]["lr"] > 0.1

    cut = spec(store, digits, "cut", checkpoint_steps=3)
    with pytest.raises(RankFailed):
        LocalLauncher(faults=(Fault("step", 0, "raise", step=7),)).run(cut, 1)
    state = load_checkpoint(store, cut.run.checkpoint)
    assert (state["epoch"], state["position"]["step"], state["lr_scheduler"]["last_epoch"]) == (0, 6, 6)
    again = replace(cut, resume_from=cut.run.checkpoint, attempt=1, launch_id="again")
    LocalLauncher().run(again, 1)
    weights, history, scheduler = trained(store, "cut")
    want_weights, want_history, want_scheduler = trained(store, "whole")
    assert scheduler["last_epoch"] == want_scheduler["last_epoch"] == 30
    assert [row["lr"] for row in history] == pytest.approx([row["lr"] for row in want_history])
    for name, value in want_weights.items():
        assert torch.allclose(weights[name], value, atol=1e-6), name


@pytest.mark.parametrize("params, named", [
    ({"lr_schedule": "linear", "lr_scheduler_fn": lambda o: torch.optim.lr_scheduler.StepLR(o, 1)},
     "lr_schedule or lr_scheduler_fn, not both"),
    ({"warmup_steps": 10, "warmup_ratio": 0.1}, "warmup_steps or warmup_ratio, not both"),
    ({"warmup_ratio": 0.1, "train_fn": lambda ctx: None, "loss": None, "label_cols": None},
     "warmup_ratio is stepped by the built-in loop.*train_fn"),
    ({"lr_schedule": "exponential"}, "lr_schedule.*'constant', 'linear', 'cosine' or None"),
    ({"warmup_ratio": 1.5}, "warmup_ratio.*a number in \\[0, 1\\)"),
    ({"packing": True}, "packing=True packs a causal LM's tokenized rows.*this fit is not one"),
])
def test_what_would_set_the_rate_twice_or_pack_a_table_that_is_not_text_is_refused_by_name(store, params, named):
    from estimator import TorchEstimator

    model = MLP()
    estimator = TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               loss=torch.nn.functional.cross_entropy, feature_cols=["features"],
                               label_cols=["label"], store=store)
    with pytest.raises((ValueError, TypeError), match=named):
        estimator.setParams(**params)._checked()


def test_a_warmup_longer_than_the_fit_is_told_with_where_the_rate_ends(caplog):
    import logging

    from estimator.fit.checks import warn_of_long_warmup

    with caplog.at_level(logging.WARNING, logger="estimator"):
        for warmup, steps in ((10, 11), (None, 5), (0, 5), (10, None)):  # shorter, unset, or steps not known
            warn_of_long_warmup({"warmup_steps": warmup}, steps)
        assert caplog.text == ""
        warn_of_long_warmup({"warmup_steps": 10_000}, 10)
    assert ("warmup_steps=10000 is at least the fit's 10 optimizer steps: the warmup takes the whole fit, the "
            "learning rate rising toward lr and at 0.0009 of it at the last step") in caplog.text
    assert WarmupSchedule("linear", 10_000, 10)(9) == pytest.approx(0.0009)  # the rate the message gives
