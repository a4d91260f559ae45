"""output_kind='score' on an executor's worker, without Spark (estimator.predict.kinds.score, estimator.lm.scoring):
each row's summed log-probability of the tokens a fit's loss counts, equal to a hand computation with the model,
one row at a time, for a prompt and its response, a whole text, a chat's assistant turns, a preference pair's two
answers (and their log-ratios to the adapters off), with LoRA adapters and through the model's own logits; rows longer than max_length cut as a fit cuts them and flagged."""
import functools
import json
import math

import numpy as np
import pytest
import torch

from test_lm import llama, tokenizer  # noqa: F401 - the tiny Llama and its tokenizer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def predictor(path, tokenizer, label_cols=(), batch_size=None, **params):  # noqa: F811
    from estimator import TorchModel

    model = TorchModel(model=functools.partial(transformers.AutoModelForCausalLM.from_pretrained, path),
                       tokenizer=tokenizer, feature_cols=["prompt"], label_cols=list(label_cols),
                       output_kind="score", inference_batch_size=batch_size, **params)
    return model._predictor(model.validated())


def by_hand(model, ids, labels):
    """The row alone: the log-probability of each labelled token given the ones before it, summed."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    scored = [(t, label) for t, label in enumerate(labels) if t > 0 and label != -100]
    return sum(float(logp[t - 1, label]) for t, label in scored), len(scored)


def columns(rows):
    return [np.array(list(c), dtype=object) for c in zip(*rows)]


def score(pred, model, rows):
    out = pred.predict(model, columns(rows), "cpu")
    return [a.to_pylist() for a in out]


def test_a_response_is_scored_given_its_prompt_as_by_hand_with_and_without_adapters(llama, tokenizer):  # noqa: F811
    from lm_helpers import color_facts, plain_causal_lm

    rows = color_facts()[:7] + [("Say it:", " a much longer answer than the others, to pad the batch with")]
    pred = predictor(llama, tokenizer, ["response"], batch_size=3)
    assert pred.input_cols() == ("prompt", "response")
    for adapters in (None, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")):
        model = plain_causal_lm(llama, adapters).eval()
        if adapters is not None:  # adapters that change the numbers (peft starts lora_B at 0)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.normal_(0, 0.5)
        logprob, tokens, perplexity, truncated = score(pred, model, rows)
        for i, (prompt, response) in enumerate(rows):
            p = tokenizer(prompt)["input_ids"]
            r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            want, count = by_hand(model, p + r, [-100] * len(p) + r)
            assert tokens[i] == count == len(r) and logprob[i] == pytest.approx(want, abs=1e-4), (i, adapters)
            assert perplexity[i] == pytest.approx(math.exp(-want / count), rel=1e-4)
        assert truncated == [False] * len(rows)
    base = score(pred, plain_causal_lm(llama).eval(), rows)[0]
    assert not np.allclose(base, logprob, atol=1e-2)  # the adapters were scored, not the base alone


def test_a_text_is_scored_whole_cut_at_max_length_and_flagged_and_the_logits_path_agrees(llama, tokenizer,  # noqa: F811
                                                                                         monkeypatch):
    from estimator.lm import scoring
    from lm_helpers import plain_causal_lm

    texts = [("The kettle is teal and the lantern is red.",), ("Hi",), ("The anchor is " + "very " * 30 + "blue.",)]
    model = plain_causal_lm(llama).eval()
    pred = predictor(llama, tokenizer, max_length=12)
    logprob, tokens, perplexity, truncated = score(pred, model, texts)
    for i, (text,) in enumerate(texts):
        ids = (tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])
        want, count = by_hand(model, ids[:12], ids[:12])
        assert tokens[i] == count == min(len(ids), 12) - 1 and logprob[i] == pytest.approx(want, abs=1e-4)
        assert truncated[i] == (len(ids) > 12)
    assert truncated[1:] == [False, True]  # "Hi" whole, the long one cut
    monkeypatch.setattr(scoring, "output_head", lambda m: (None, "no head"))  # the model's own logits instead
    again = score(pred, model, texts)
    assert again[0] == pytest.approx(logprob, abs=1e-5) and again[1] == tokens


def test_a_chats_assistant_turns_are_scored_and_a_row_with_nothing_scored_has_no_perplexity(llama,  # noqa: F811
                                                                                           tokenizer):
    from estimator.data.lm import chat_tokens
    from lm_helpers import plain_causal_lm

    chats = [[{"role": "user", "content": "What color is the kettle?"},
              {"role": "assistant", "content": "The kettle is teal."},
              {"role": "user", "content": "And the drum?"}, {"role": "assistant", "content": "Red."}],
             [{"role": "user", "content": "Nothing answered"}]]
    model = plain_causal_lm(llama).eval()
    pred = predictor(llama, tokenizer).bind_chat(True)
    values = np.empty(len(chats), dtype=object)
    values[:] = chats
    logprob, tokens, perplexity, truncated = [a.to_pylist() for a in pred.predict(model, [values], "cpu")]
    ids, labels = chat_tokens(tokenizer, chats[0], "prompt")
    want, count = by_hand(model, ids, labels)
    assert tokens[0] == count > 0 and logprob[0] == pytest.approx(want, abs=1e-4)
    assert tokens[1] == 0 and logprob[1] == 0.0 and perplexity[1] is None


def test_a_pairs_answers_are_scored_given_the_prompt_with_their_log_ratios_to_the_adapters_off(  # noqa: F811
        llama, tokenizer):
    """label_cols=[chosen, rejected]: each answer as a response alone; the log-ratio is the answer's log-probability
    with the adapters less that with them off (DPO's reference), null for a model without adapters."""
    from lm_helpers import plain_causal_lm

    rows = [("What color is the kettle?", " The kettle is teal.", " The kettle is a very red thing."),
            ("Say it:", " Blue.", " Red, and then a longer answer than the chosen one.")]
    pred = predictor(llama, tokenizer, ["chosen", "rejected"], batch_size=3)
    assert pred.input_cols() == ("prompt", "chosen", "rejected")
    assert [a.name for a in pred.added] == ["chosen_logprob", "rejected_logprob", "chosen_tokens", "rejected_tokens",
                                            "chosen_logratio", "rejected_logratio", "truncated"]
    model = plain_causal_lm(llama, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                   task_type="CAUSAL_LM")).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    got = dict(zip([a.name for a in pred.added], score(pred, model, rows)))
    for i, (prompt, *answers) in enumerate(rows):
        p = tokenizer(prompt)["input_ids"]
        for side, answer in zip(("chosen", "rejected"), answers):
            r = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            want, count = by_hand(model, p + r, [-100] * len(p) + r)
            with model.disable_adapter():
                reference, _ = by_hand(model, p + r, [-100] * len(p) + r)
            assert got[f"{side}_tokens"][i] == count and got[f"{side}_logprob"][i] == pytest.approx(want, abs=1e-4)
            assert got[f"{side}_logratio"][i] == pytest.approx(want - reference, abs=1e-4)
            assert abs(want - reference) > 0.1, (i, side)  # the adapters change the numbers
    plain = dict(zip([a.name for a in pred.added], score(pred, plain_causal_lm(llama).eval(), rows)))
    assert plain["chosen_logratio"] == plain["rejected_logratio"] == [None, None]
    assert plain["truncated"] == [False, False]


def test_what_score_cannot_read_is_refused_by_name(llama, tokenizer):  # noqa: F811
    from estimator import TorchModel

    with pytest.raises(ValueError, match=r"output_kind='score' scores one response column .* got label_cols=\['a', "
                                         r"'b', 'c'\]"):
        predictor(llama, tokenizer, ["a", "b", "c"])
    encoder = TorchModel(model=functools.partial(transformers.AutoModel.from_pretrained, llama), tokenizer=tokenizer,
                         feature_cols=["prompt"], output_kind="score")
    with pytest.raises(ValueError, match=r"output_kind='score' needs a causal LM"):
        encoder._predictor(encoder.validated())
    as_json = np.array([json.dumps([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Red."}])],
                       dtype=object)  # a chat kept as JSON text: its JSON would be scored (a task's refusal)
    with pytest.raises(ValueError, match=r"holds chats written as JSON text .* its JSON would be scored as the text\. "
                                         r"Parse it .*F\.from_json\('prompt'"):
        predictor(llama, tokenizer).predict(None, [as_json], "cpu")  # refused before the model is read
