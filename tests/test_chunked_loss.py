"""The causal LM's loss computed chunk by chunk from the last hidden states (estimator.lm.chunked_loss)
equals the plain float32 cross entropy over the model's logits (token_loss), in value and in every trainable
parameter's gradient, with and without peft's LoRA (on lm_head too), with prompts, padding and chunk boundaries
inside sequences; and the rule that says when it applies, both ways."""
import math

import numpy as np
import pytest
import torch

from estimator.core.spec import LMSpec
from estimator.data.rows import PromptResponse
from estimator.data.lm import IGNORE, CausalLMTokenize
from estimator.lm import chunked_loss
from estimator.lm.chunked_loss import output_head
from estimator.train.objectives.tokens import TokenObjective, token_loss
from lm_helpers import lm_rows, plain_causal_lm, save_pretrained_llama

peft = pytest.importorskip("peft")

CHUNK = 7  # positions per chunk in these tests: boundaries fall inside the rows' responses


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    rows = lm_rows(8)
    return save_pretrained_llama(str(tmp_path_factory.mktemp("llama") / "tiny"), [p + r for p, r in rows] * 4)


@pytest.fixture(scope="module")
def batch(llama):
    """Four rows of different lengths: prompts (IGNORE), responses, right padding (IGNORE, attention_mask 0)."""
    from transformers import AutoTokenizer

    rows = lm_rows(4)
    tokens = CausalLMTokenize(AutoTokenizer.from_pretrained(llama), LMSpec(PromptResponse("prompt", "response")), None)(
        {"prompt": np.array([p for p, _ in rows], dtype=object), "response": np.array([r for _, r in rows],
                                                                                      dtype=object)})
    ids, mask, labels = (torch.from_numpy(tokens[k]) for k in ("prompt.input_ids", "prompt.attention_mask",
                                                                 "response"))
    assert (mask == 0).any() and (labels[:, 1:] == IGNORE).any()
    return [{"input_ids": ids, "attention_mask": mask}], [labels], None


@pytest.fixture
def counted(monkeypatch, llama):
    """CHUNK positions per chunk, and the chunks the chunked loss computed (a test whose model took the plain path
    would compare the plain loss with itself)."""
    from transformers import AutoConfig

    calls = []
    real = chunked_loss.chunk_loss

    def counting(logits, targets, gradient=False, masked=False):
        calls.append(logits.shape[0])
        return real(logits, targets, gradient, masked)

    monkeypatch.setattr(chunked_loss, "chunk_loss", counting)
    monkeypatch.setattr(chunked_loss, "CHUNK_BYTES", 4 * AutoConfig.from_pretrained(llama).vocab_size * CHUNK)
    return calls


def lora(targets="all-linear"):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM", init_lora_weights=False)


def plain(model, tensors):
    """token_loss over the model's full logits, and the gradients of what trains."""
    features, labels, _ = tensors
    loss, tokens = token_loss(model(**features[0]).logits, labels[0])
    return loss, tokens, grads_of(model, loss)


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    (loss * 0.5).backward()  # a scale, as the loop's weighting gives the loss before backward
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("every_position", [False, True], ids=["labelled", "every-position"])
@pytest.mark.parametrize("adapters", [None, "all-linear", ["q_proj", "v_proj", "lm_head"]],
                         ids=["full", "lora", "lora-on-lm_head"])
def test_the_chunked_loss_and_its_gradients_equal_the_plain_float32_loss(llama, batch, counted, adapters,
                                                                         every_position, monkeypatch):
    """On the CPU the labelled positions only; `every_position`: a GPU's way (no count read by the host: every
    position through the head, the unlabelled ones weighed 0), run here on the CPU."""
    if every_position:
        monkeypatch.setattr(chunked_loss, "PICKED_ON", frozenset())
    model = plain_causal_lm(llama, None if adapters is None else lora(adapters)).train()
    head, why = output_head(model)
    assert head is not None, why
    if adapters is not None and "lm_head" in adapters:
        assert hasattr(head, "lora_A"), type(head)  # peft's layer: the chunks run its adapters
    want_loss, want_tokens, want = plain(model, batch)
    loss, sums = TokenObjective().on_batch(model, batch)
    labelled = int((batch[1][0][:, 1:] != IGNORE).sum()) if not every_position else batch[1][0][:, 1:].numel()
    assert counted == [CHUNK] * (labelled // CHUNK) + ([labelled % CHUNK] if labelled % CHUNK else [])
    assert sums.tolist()[1:] == [float(want_tokens), 4.0]
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    got = grads_of(model, loss)
    assert set(got) == set(want) and len(got) > 0
    for name in want:  # float32's summation order differs: within 1e-5 of the gradient's largest element
        error = (got[name] - want[name]).abs().max().item()
        assert error <= 1e-5 * want[name].abs().max().item(), (name, error)
    with torch.no_grad():  # validation's path: the chunks without gradients
        assert TokenObjective().on_batch(model.eval(), batch)[0].item() == pytest.approx(want_loss.item(), rel=1e-5)


def test_the_chunked_loss_reads_the_next_token_of_each_position(llama, batch, counted):
    """The shift: the hidden state at t is scored against the label at t + 1 (a loss without it differs)."""
    model = plain_causal_lm(llama).eval()
    ids, labels = batch[0][0]["input_ids"], batch[1][0]
    with torch.no_grad():
        logits = model(**batch[0][0]).logits
        want = token_loss(logits, labels)[0]
        unshifted = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                      ignore_index=IGNORE, reduction="sum")
        got = TokenObjective().on_batch(model, batch)[0]
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert not math.isclose(unshifted.item(), want.item(), rel_tol=1e-3)
    assert ids.shape == labels.shape


class Wrapper(torch.nn.Module):
    """What the loop trains through (DDP, FSDP's, one rank's stand-in): called like the model, with `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_the_rule_takes_the_chunked_path_for_a_causal_lm_with_or_without_adapters_inside_a_wrapper(llama):
    model = plain_causal_lm(llama)
    assert output_head(model) == (model.lm_head, "")
    assert output_head(Wrapper(model))[0] is model.lm_head
    adapted = plain_causal_lm(llama, lora(["q_proj", "lm_head"]))
    assert output_head(Wrapper(adapted))[0] is adapted.get_base_model().lm_head


def tiny(cls_name, config_name, **fields):
    import transformers

    config = getattr(transformers, config_name)(vocab_size=50, hidden_size=16, intermediate_size=32,
                                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                head_dim=8, **fields)
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(config)


def test_the_rule_keeps_the_plain_path_where_the_forward_changes_the_logits_or_the_model_is_not_known(llama):
    from transformers import AutoConfig

    gemma2 = tiny("Gemma2ForCausalLM", "Gemma2Config", final_logit_softcapping=5.0)
    assert "final_logit_softcapping" in output_head(gemma2)[1]
    assert "logit_scale" in output_head(tiny("CohereForCausalLM", "CohereConfig", logit_scale=0.5))[1]
    assert "not a transformers model" in output_head(torch.nn.Linear(3, 4))[1]
    tuned = peft.get_peft_model(plain_causal_lm(llama), peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                                                num_virtual_tokens=2))
    assert "prompt-learning" in output_head(tuned)[1]
    hooked = plain_causal_lm(llama)
    hooked.lm_head.register_forward_pre_hook(lambda module, args: None)
    assert "hooks" in output_head(hooked)[1]
    config = AutoConfig.from_pretrained(llama)
    from transformers import LlamaForCausalLM

    assert output_head(LlamaForCausalLM(config))[0] is not None  # the same model, no hook: chunked


def test_a_softcapped_model_keeps_the_plain_loss(counted):
    model = tiny("Gemma2ForCausalLM", "Gemma2Config", final_logit_softcapping=0.5)  # a cap the logits reach
    ids = torch.randint(0, 50, (2, 9))
    labels = torch.where(torch.rand(2, 9) < 0.3, IGNORE, ids)
    tensors = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], [labels], None
    with torch.no_grad():
        want = token_loss(model(input_ids=ids).logits, labels)[0]
        assert TokenObjective().on_batch(model, tensors)[0].item() == pytest.approx(want.item(), rel=1e-6)
    assert counted == []


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "new-tensor"])
def test_a_forward_that_changes_its_heads_output_is_caught_and_the_batch_computed_the_plain_way(llama, batch,
                                                                                                counted, in_place):
    """A model the rule does not know (its config names no scale), whose forward scales the logits."""
    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):
        def forward(self, **kwargs):
            out = super().forward(**kwargs)
            if in_place:
                out.logits.mul_(3.0)
            else:
                out.logits = out.logits * 3.0
            return out

    model = Scaled.from_pretrained(llama).eval()
    assert output_head(model)[0] is not None
    objective = TokenObjective()
    with torch.no_grad():
        want = token_loss(model(**batch[0][0]).logits, batch[1][0])[0]
        assert objective.on_batch(model, batch)[0].item() == pytest.approx(want.item(), rel=1e-6)
        assert objective.on_batch(model, batch)[0].item() == pytest.approx(want.item(), rel=1e-6)
    assert counted == []  # found once, then the plain path directly


def test_under_autocast_a_frozen_heads_weight_is_cast_once_with_the_same_numbers(llama, batch, counted, monkeypatch):
    """bf16 autocast (on the CPU here): the chunks call the head's weight cast once (cast_once), and the loss and
    gradients are bit for bit those of the head called as a module, chunk by chunk (autocast's own casts)."""
    model = plain_causal_lm(llama, lora()).train()
    head = output_head(model)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert chunked_loss.cast_once(head, torch.device("cpu")) is not head
    assert chunked_loss.cast_once(head, torch.device("cpu")) is head  # no autocast: the module

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = TokenObjective().on_batch(model, batch)[0]
        return loss, grads_of(model, loss)

    loss, grads = run()
    monkeypatch.setattr(chunked_loss, "cast_once", lambda head, device: head)
    want_loss, want = run()
    assert torch.equal(loss, want_loss) and set(grads) == set(want) and len(want) > 0
    assert all(torch.equal(grads[name], want[name]) for name in want)
