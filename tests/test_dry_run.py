"""The driver's dry run and the loss/metric rules: mistakes that plain PyTorch refuses, or that would train on
broadcast numbers, fail before launching with a message naming what to change."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from estimator.core.pickling import user_objects
from estimator.core.spec import DataSpec
from estimator.data.parquet import list_pieces
from estimator.data.arrays import Tensors
from estimator.data.row_checks import BadRows
from estimator.fit.dry_run import dry_run
from estimator.train.objectives.classic import Objective
from estimator.train.sums import split


def _data(store, labels, width=4, label_width=None):
    rows = len(labels)
    x = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32)
    y = pa.array(list(labels)) if label_width is None else pa.array(list(np.tile(labels[:, None], label_width)))
    store.makedirs(store.path("train"))
    pq.write_table(pa.table({"x": pa.array(list(x)), "y": y}), store.path("train", "part.parquet"),
                   row_group_size=max(rows // 3, 1))
    return DataSpec(store, list_pieces(store, store.path("train")), (), ("x",), ("y",))


def _objs(model, loss, metrics=()):
    model.scale = nn.Parameter(torch.ones(1))  # the test models without weights still need an optimizer
    return user_objects(model, torch.optim.SGD(model.parameters(), lr=0.1), [loss], [1.0], list(metrics))


def test_cross_entropy_against_one_output_unit_is_refused(store):
    data = _data(store, np.array([0, 1] * 20, dtype=np.int64))
    with pytest.raises(ValueError, match=r"CrossEntropyLoss needs one output per class, but the model's output for "
                                         r"label 'y' has 1 unit .* BCEWithLogitsLoss"):
        dry_run(_objs(nn.Linear(4, 1), nn.CrossEntropyLoss()), data)
    with pytest.raises(ValueError, match="NLLLoss needs one output per class"):
        dry_run(_objs(nn.Linear(4, 1), nn.NLLLoss()), data)


def test_fewer_output_classes_than_the_largest_label_is_refused_with_both_numbers(store):
    labels = np.array([0, 1, 2] * 10 + [7], dtype=np.float64)  # the 7 is in the last row group only
    data = _data(store, labels)
    with pytest.raises(ValueError, match=r"Label column 'y' holds class 7, but the model's output has 3 classes "
                                         r"\(0-2\) for CrossEntropyLoss: give the last layer at least 8 outputs"):
        dry_run(_objs(nn.Linear(4, 3), nn.CrossEntropyLoss()), data)
    assert dry_run(_objs(nn.Linear(4, 8), nn.CrossEntropyLoss()), data) == [(8,)]


def test_outputs_that_would_broadcast_against_the_labels_are_refused(store):
    """MSELoss on (rows, 2) outputs against (rows,) labels broadcasts; with 2 rows it even has matching
    sizes. The dry run uses a row count that equals no output dimension and refuses torch's warning."""
    data = _data(store, np.arange(40, dtype=np.float64))
    with pytest.raises(ValueError, match=r"The loss or metrics failed on the model's outputs \(\(13, 2\)\) and the "
                                         r"labels \(y: \(13,\) torch.float32\)"):
        dry_run(_objs(nn.Linear(4, 2), nn.MSELoss()), data)
    assert dry_run(_objs(nn.Linear(4, 1), nn.MSELoss()), data) == [(1,)]

    class Flat(nn.Module):  # (rows,) outputs against (rows, 1) labels: torch only warns, then broadcasts
        def forward(self, x):
            return x.sum(dim=1)

    data = _data(store, np.arange(40, dtype=np.float64), label_width=1)
    with pytest.raises(ValueError, match=r"outputs \(\(13,\)\) and the labels \(y: \(13, 1\) .*UserWarning: "
                                         r"Using a target size"):
        dry_run(_objs(Flat(), nn.MSELoss()), data)


def test_a_row_count_that_equals_an_output_dimension_is_avoided(store):
    data = _data(store, np.arange(40, dtype=np.float64))  # 13 rows in the first row group

    class Square(nn.Module):  # (rows, 13): 13 rows would make (rows,) labels broadcast without a warning
        def forward(self, x):
            return x[:, :1].repeat(1, 13)

    with pytest.raises(ValueError, match=r"outputs \(\(12, 13\)\)"):
        dry_run(_objs(Square(), nn.MSELoss()), data)


def test_dict_and_non_tensor_outputs_are_refused_by_name(store):
    data = _data(store, np.array([0, 1] * 20, dtype=np.int64))

    class Dict(nn.Module):
        def forward(self, x):
            return {"scores": torch.zeros(x.shape[0], 2)}

    with pytest.raises(ValueError, match=r"returned a dict \(keys \['scores'\]\) without 'logits'.* "
                                         r"return \(out\['scores'\]\)"):
        dry_run(_objs(Dict(), nn.CrossEntropyLoss()), data)

    class Logits(nn.Module):  # as Hugging Face models return them: read as its logits
        def forward(self, x):
            return {"logits": torch.zeros(x.shape[0], 2), "hidden": None}

    assert dry_run(_objs(Logits(), nn.CrossEntropyLoss()), data) == [(2,)]

    class Text(nn.Module):
        def forward(self, x):
            return "no"

    with pytest.raises(ValueError, match="returned a str as output 0; outputs must be tensors"):
        dry_run(_objs(Text(), nn.CrossEntropyLoss()), data)


def test_accuracy_reads_the_output_as_the_loss_does():
    logits = torch.tensor([[-2.0], [-0.5], [0.3], [2.0]])  # sigmoid: 0.12, 0.38, 0.57, 0.88
    target = torch.tensor([0.0, 1.0, 1.0, 1.0])

    def accuracy_of(loss, output):
        objective = Objective([loss], [1.0], ["accuracy"], ["y"], weighted=False)
        sums = objective((output,), (target,), None)[1].tolist()
        return objective.summarize(*split(objective.layout, sums, with_val=False))["accuracy"]

    assert accuracy_of(nn.BCEWithLogitsLoss(), logits) == 0.75  # logits >= 0; thresholding at 0.5 gave 0.5
    assert accuracy_of(nn.BCELoss(), torch.sigmoid(logits)) == 0.75  # probabilities >= 0.5
    scores = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.4, 0.6]])
    assert accuracy_of(nn.CrossEntropyLoss(), scores) == 0.5  # argmax
    with pytest.raises(ValueError, match="cannot tell how to read the output of the loss <lambda>"):
        accuracy_of(lambda o, t: ((o - t) ** 2).mean(), logits)


def test_accuracy_is_reported_only_for_classification_labels():
    objective = Objective([nn.CrossEntropyLoss(), nn.MSELoss()], [1.0, 0.5], ["accuracy"], ["digit", "size"],
                          weighted=False)
    assert [name for name, _, _ in objective.metrics] == ["digit_accuracy"]
    with pytest.raises(ValueError, match=r"metrics=\['accuracy'\] means nothing for y with the regression loss "
                                         r"MSELoss"):
        Objective([nn.MSELoss()], [1.0], ["accuracy"], ["y"], weighted=False)


def test_class_index_targets_are_integers_of_shape_batch():
    objective = Objective([nn.CrossEntropyLoss()], [1.0], [], ["y"], weighted=False)
    scores = torch.tensor([[3.0, 0.0], [0.0, 3.0]])
    for target in (torch.tensor([0.0, 1.0]), torch.tensor([[0.0], [1.0]]), torch.tensor([0, 1])):
        loss, _ = objective((scores,), (target,), None)
        assert torch.isclose(loss, nn.CrossEntropyLoss()(scores, torch.tensor([0, 1])))


def test_class_labels_that_are_not_whole_numbers_are_refused_not_truncated(store):
    """A double label of 0.5 (or a regression target) under CrossEntropyLoss: .long() made it class 0 and the fit
    reported accuracy 1.0 (a wheel trial). Refused by the driver's dry run (its first rows) and by each batch a
    rank reads (on the host, before a GPU copy), naming the column and the value; whole-number doubles
    (StringIndexer's) still train."""
    with pytest.raises(ValueError, match=r"Label column 'y' holds 0\.5, which is not a class index: "
                                         r"CrossEntropyLoss reads .* 6 of this batch.s 13 labels .* MSELoss"):
        dry_run(_objs(nn.Linear(4, 3), nn.CrossEntropyLoss()), _data(store, np.array([0.0, 0.5] * 20)))
    check = Objective([nn.NLLLoss()], [1.0], [], ["grade"], weighted=False).host_check()  # each batch's, as read
    with pytest.raises(BadRows, match=r"Label column 'grade' holds 2\.7, which is not a class index: NLLLoss"):
        check(Tensors([torch.zeros(3, 4)], [torch.tensor([[0.0], [2.7], [1.0]])], None))
    check(Tensors([torch.zeros(3, 4)], [torch.tensor([0.0, 2.0, 1.0])], None))
    probabilities = torch.tensor([[0.3, 0.7], [1.0, 0.0]])  # CrossEntropyLoss's class probabilities stay floats
    objective = Objective([nn.CrossEntropyLoss()], [1.0], [], ["y"], weighted=False)
    objective.host_check()(Tensors([torch.zeros(2, 2)], [probabilities], None))
    loss, _ = objective((torch.zeros(2, 2),), (probabilities,), None)
    assert torch.isclose(loss, nn.CrossEntropyLoss()(torch.zeros(2, 2), probabilities))
    assert Objective([nn.MSELoss()], [1.0], [], ["y"], weighted=False).host_check() is None


def test_negative_class_labels_are_refused_except_the_loss_s_ignore_index(store):
    """A -1 among class indices (a wheel trial's) passed the driver's checks and failed on a rank after the data
    job, as the loss's IndexError. Refused from the Parquet footers of the whole data (a -1 in the last row group,
    not among the dry run's rows) and by each batch a rank reads; CrossEntropyLoss's ignore_index (-100) still
    marks rows to leave out."""
    labels = np.array([0, 1, 2] * 10 + [-1], dtype=np.int64)
    with pytest.raises(ValueError, match=r"Label column 'y' holds -1, which is not a class index: CrossEntropyLoss "
                                         r"reads each label as the index of a class, from 0 \(only its ignore_index, "
                                         r"-100, marks a row to leave out\)\. Re-index"):
        dry_run(_objs(nn.Linear(4, 3), nn.CrossEntropyLoss()), _data(store, labels))
    dry_run(_objs(nn.Linear(4, 3), nn.CrossEntropyLoss()), _data(store, np.array([0, 1, 2] * 10 + [-100])))
    check = Objective([nn.NLLLoss(ignore_index=-1)], [1.0], [], ["grade"], weighted=False).host_check()
    check(Tensors([torch.zeros(3, 4)], [torch.tensor([0, -1, 1])], None))  # its ignore_index
    with pytest.raises(BadRows, match=r"Label column 'grade' holds -2, which is not a class index: NLLLoss"):
        check(Tensors([torch.zeros(3, 4)], [torch.tensor([0, -2, 1])], None))
    with pytest.raises(BadRows, match=r"holds -1, which is not a class index"):
        Objective([nn.CrossEntropyLoss()], [1.0], [], ["y"], weighted=False).host_check()(
            Tensors([torch.zeros(2, 3)], [torch.tensor([[1.0], [-1.0]])], None))


def _weighted(store, weights):
    """_data's rows with a sample weight column `w` (the last row group holds the last weights)."""
    rows = len(weights)
    x = np.random.default_rng(0).standard_normal((rows, 4)).astype(np.float32)
    store.makedirs(store.path("weighted"))
    pq.write_table(pa.table({"x": pa.array(list(x)), "y": pa.array([0, 1, 2] * (rows // 3)), "w": pa.array(weights)}),
                   store.path("weighted", "part.parquet"), row_group_size=rows // 3)
    return DataSpec(store, list_pieces(store, store.path("weighted")), (), ("x",), ("y",), sample_weight_col="w")


def test_negative_sample_weights_and_weights_all_zero_are_refused_from_the_whole_data(store):
    """A wheel trial's -1.0 weight trained silently (the row's loss raised, not lowered), and weights all 0
    failed after a whole epoch as a non-finite loss with advice about the lr. Both refused by the driver from the
    Parquet footers (the -1 is in the last row group only, past the dry run's rows); each batch a rank reads is
    checked for negative weights too (the direct mode has no footers). Zero weights leave rows out: allowed."""
    model = nn.Linear(4, 3)
    weights = np.array([1.0, 0.5, 2.0] * 10, dtype=np.float32)
    dry_run(_objs(model, nn.CrossEntropyLoss()), _weighted(store, np.where(np.arange(30) < 5, 0.0, weights)))
    with pytest.raises(ValueError, match=r"Column 'w' \(sample_weight_col\) holds the weight -1 \(weights from -1 to "
                                         r"2\): a weight scales its row's loss, and a negative one would make "
                                         r"training raise that row's loss"):
        dry_run(_objs(model, nn.CrossEntropyLoss()), _weighted(store, np.append(weights[:-1], -1.0)))
    with pytest.raises(ValueError, match=r"Column 'w' \(sample_weight_col\) holds only 0: every row's loss is "
                                         r"weighted 0, so nothing would train"):
        dry_run(_objs(model, nn.CrossEntropyLoss()), _weighted(store, np.zeros(30, dtype=np.float32)))
    check = Objective([nn.MSELoss()], [1.0], [], ["y"], weighted=True, weight_col="w").host_check()
    check(Tensors([torch.zeros(3, 4)], [torch.zeros(3)], torch.tensor([0.0, 1.0, 2.0])))
    with pytest.raises(BadRows, match=r"Column 'w' \(sample_weight_col\) holds the weight -0.5 \(1 of this batch's 3 "
                                      r"rows are negative\)"):
        check(Tensors([torch.zeros(3, 4)], [torch.zeros(3)], torch.tensor([0.0, -0.5, 2.0])))


def test_functional_losses_take_sample_weights_with_reduction_none():
    objective = Objective([nn.functional.binary_cross_entropy], [1.0], [], ["y"], weighted=True)
    p = torch.tensor([[0.9], [0.2]])
    y = torch.tensor([1.0, 1.0])
    loss, sums = objective((p,), (y,), torch.tensor([1.0, 3.0]))
    expected = -np.log(0.9) * 1 - np.log(0.2) * 3  # the weighted sum, over the weight 4 (PerWeight)
    assert loss.item() == pytest.approx(expected, rel=1e-6) and sums[1].item() == 4.0


def test_binary_losses_refuse_labels_outside_zero_one_from_the_whole_data(store):
    """-1/+1 labels with BCEWithLogitsLoss train without an error to a loss below 0 and accuracy 0; the range
    comes from the Parquet footers, so a -1 in the last row group (not among the dry run's rows) is found."""
    labels = np.array([1.0] * 30 + [-1.0], dtype=np.float32)
    data = _data(store, labels)
    for loss in (nn.BCEWithLogitsLoss(), nn.BCELoss()):
        with pytest.raises(ValueError, match=r"Label column 'y' holds -1 \(values from -1 to 1\), but "
                                             rf"{type(loss).__name__} needs labels in \[0, 1\].*\(label \+ 1\) / 2"):
            dry_run(_objs(nn.Sequential(nn.Linear(4, 1), nn.Sigmoid()), loss), data)
    ok = _data(store, np.array([0.0, 1.0, 0.25] * 10, dtype=np.float32))  # probabilities are labels too
    assert dry_run(_objs(nn.Linear(4, 1), nn.BCEWithLogitsLoss()), ok) == [(1,)]
    # the direct mode has no footers: its first rows are checked
    direct = DataSpec(store, (), (), ("x",), ("y",))
    head = {"x": np.zeros((6, 4), np.float32), "y": np.array([0, 2, 1, 0, 1, 0], np.float32)}
    with pytest.raises(ValueError, match="holds 2 "):
        dry_run(_objs(nn.Linear(4, 1), nn.BCEWithLogitsLoss()), direct, head)


class ProblemTypeFromLabels(nn.Linear):
    """As a Hugging Face *ForSequenceClassification picks its loss: integer labels are class indices, float labels
    one target per class (multi-label, BCEWithLogitsLoss)."""

    def forward(self, x, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = super().forward(x)
        loss = None
        if labels is not None:
            loss = (nn.functional.binary_cross_entropy_with_logits(logits, labels) if labels.is_floating_point()
                    else nn.functional.cross_entropy(logits, labels))
        return SequenceClassifierOutput(loss=loss, logits=logits)


def test_float_class_labels_for_a_models_own_loss_are_told_to_be_integers(store):
    from estimator.train.losses import ModelsOwnLoss

    indexed = _data(store, np.array([0.0, 1.0, 2.0] * 10))  # StringIndexer's output: a double
    with pytest.raises(ValueError, match=r"The model computes its own loss from the labels.*float labels as several "
                                         r"targets.*F.col\('y'\).cast\('int'\)"):
        dry_run(_objs(ProblemTypeFromLabels(4, 3), ModelsOwnLoss()), indexed)
    store.rm(store.path("train"))
    classes = _data(store, np.array([0, 1, 2] * 10))
    assert dry_run(_objs(ProblemTypeFromLabels(4, 3), ModelsOwnLoss()), classes) == [(3,)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from lm_helpers import color_facts, save_pretrained_llama

    return save_pretrained_llama(str(tmp_path_factory.mktemp("llama") / "tiny"),
                                 [p + r for p, r in color_facts()] * 4)


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_a_causal_lms_dry_run_is_its_objectives_and_refuses_rows_without_a_token_to_learn(store, llama, objective):
    """The objective's own dry run (SFT's and DPO's: dry_tokens): the loss on a few rows where the driver holds the
    weights, the labelled tokens counted on a skeleton; rows whose prompts fill max_length, and a model that fails,
    refused by name."""
    import dataclasses

    import cloudpickle

    from lm_helpers import lm_train_spec
    from estimator.core.recipe import built_on_meta
    from estimator.train.objectives.preference import DPO

    facts = [("What color is the kettle?", " The kettle is red."), ("What color is the anchor?", " It is blue.")] * 4
    rows, more = (facts, {}) if objective == "sft" else ([(p, r, " No.") for p, r in facts], {"objective": DPO()})
    spec = lm_train_spec(store, llama, rows, batch=2, epochs=1, **more)
    sent = cloudpickle.loads(spec.payload)

    def objs(model):
        return dataclasses.replace(sent, model=model)

    assert dry_run(objs(sent.model_factory()), spec.data) == []  # transform writes text: no output shape
    short = dataclasses.replace(spec.data, max_length=4)
    for model in (sent.model_factory(), built_on_meta(sent.model_factory)):  # weights; a LoRA fit's driver's
        with pytest.raises(ValueError, match=r"The first \d+ training rows have no response token left after "
                                             r"max_length=4: the prompts fill it"):
            dry_run(objs(model), short)
    broken = sent.model_factory()
    broken.model.embed_tokens = None  # a forward that fails
    with pytest.raises(ValueError, match=r"The causal LM failed on \d+ training rows of 'prompt' \(tokens "
                                         r"\{input_ids: \(\d+, \d+\)"):
        dry_run(objs(broken), spec.data)
    assert dry_run(objs(built_on_meta(sent.model_factory)), spec.data) == []  # the skeleton: counted, no forward
