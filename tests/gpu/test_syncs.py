"""Inside an epoch the host never waits for the GPU (`bash .ci/gpu`): torch.cuda's sync debug mode, on from the
epoch's second step to its last but one, counts every synchronizing call of the rank's thread and the feed's -
the copies from pinned memory, the loss and metric sums, the seeds, the optimizer step. Our loop may add none but
the documented look at the losses (terminate_on_nan: one every FiniteCheck.LOOK_EVERY steps); a model's own syncs
(a Hugging Face model's) are counted in a plain loop over the same batches and allowed as many. A DDP epoch (one
rank: DDP's stand-in; the copies, sums and steps are the same code), an epoch tokenized on the rank (a causal LM's
SFT), and an fsdp epoch (FSDP2 on one GPU). Skipped without a CUDA device."""
import warnings

import numpy as np
import pytest
import torch

from estimator.launch.local import LocalLauncher
from estimator.train import loop as loop_module
from estimator.train.finite import FiniteCheck
from helpers import MLP, BlockMLP, make_spec, seeded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


class Watch:
    """The loop's batches (estimator.train.copy_ahead) watched: the debug mode 'warn' from the second training
    step to the last but one of each epoch; the warnings it gives are the syncs."""

    def __init__(self, monkeypatch):
        self.steps, self.syncs, original = 0, [], loop_module.copied_ahead

        def watched(batches, device):
            try:
                for index, (batch, last) in enumerate(original(batches, device)):
                    if index == 1 and not last:
                        torch.cuda.set_sync_debug_mode("warn")
                    if last:
                        torch.cuda.set_sync_debug_mode(0)
                    elif index >= 1:
                        self.steps += 1
                    yield batch, last
            finally:
                torch.cuda.set_sync_debug_mode(0)

        monkeypatch.setattr(loop_module, "copied_ahead", watched)

    def run(self, spec, ranks=1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = LocalLauncher().run(spec, ranks)  # in this process: the mode and the warnings are its own
        self.syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        return results


def allowed(steps):
    return steps // FiniteCheck.LOOK_EVERY + 1  # terminate_on_nan's look at the deferred losses


def spec_for(store, digits, run, **fields):
    model = seeded(MLP if fields.get("strategy") != "fsdp" else BlockMLP)
    return make_spec(store, digits, model, torch.optim.AdamW(model.parameters(), lr=0.01), train_rows=1400,
                     val_rows=300, batch=32, epochs=1, run=run, use_gpu=True, **fields)


@pytest.mark.parametrize("fields", [{}, {"precision": "bf16-mixed"}, {"strategy": "fsdp", "shard_alone": True}],
                         ids=["ddp", "ddp-bf16", "fsdp"])
def test_an_epoch_on_the_gpu_makes_the_host_wait_only_for_the_documented_look(store, digits, monkeypatch, fields):
    watch = Watch(monkeypatch)
    (result,) = watch.run(spec_for(store, digits, "syncs", **fields))
    assert result.device == "cuda:0" and watch.steps >= 40  # 44 batches a training epoch, 10 validation
    if fields.get("strategy") == "fsdp":
        assert "reduce-scatter" in result.allreduce  # really sharded (FSDP2's hooks ran)
    assert len(watch.syncs) <= allowed(watch.steps), watch.syncs[:5]


def test_an_epoch_tokenized_on_the_rank_waits_no_more_than_the_models_own_loop(store, monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from estimator.core.spec import LMSpec
    from estimator.data.rows import PromptResponse
    from estimator.data.lm import CausalLMTokenize
    from lm_helpers import color_facts, lm_rows, lm_train_spec, save_pretrained_llama

    path = save_pretrained_llama(str(tmp_path / "tiny"), [p + r for p, r in color_facts()])
    rows, batch = lm_rows(96), 4
    watch = Watch(monkeypatch)
    (result,) = watch.run(lm_train_spec(store, path, rows, batch=batch, epochs=1, use_gpu=True))
    assert result.device == "cuda:0" and watch.steps >= 20
    # the model's own syncs: a plain loop over the same batches on the same device, counted the same way
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to("cuda:0")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokenize = CausalLMTokenize(tokenizer, LMSpec(PromptResponse("prompt", "response")), None)
    batches = []
    for start in range(0, len(rows), batch):
        part = rows[start:start + batch]
        b = tokenize({"prompt": np.array([p for p, _ in part], dtype=object),
                      "response": np.array([r for _, r in part], dtype=object)})
        batches.append({k: torch.from_numpy(v).pin_memory().to("cuda:0", non_blocking=True) for k, v in b.items()})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, b in enumerate(batches[:-1]):
            if index == 1:
                torch.cuda.set_sync_debug_mode("warn")
            logits = model(input_ids=b["prompt.input_ids"], attention_mask=b["prompt.attention_mask"]).logits
            torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                              b["response"][:, 1:].reshape(-1), ignore_index=-100).backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.set_sync_debug_mode(0)
    own = [w for w in caught if "synchroniz" in str(w.message).lower()]
    per_step = len(own) / max(1, len(batches) - 2)
    assert len(watch.syncs) <= per_step * watch.steps + allowed(watch.steps), (per_step, watch.syncs[:5])


def test_a_packed_epoch_in_bf16_waits_no_more_than_the_same_epoch_unpacked(store, monkeypatch, tmp_path):
    """packing=True on CUDA (bf16-mixed: torch's variable-length flash attention): the rows' boundaries come with
    the batch, so the packed attention reads nothing back; the host waits no more often than unpacked. Nor with
    LoRA over a base whose frozen linear layers are kept in bf16 and gradient_checkpointing='selective' (the
    recomputation in backward, its cache of kept outputs)."""
    from peft import LoraConfig

    from lm_helpers import color_facts, lm_rows, lm_train_spec, save_pretrained_llama

    path = save_pretrained_llama(str(tmp_path / "tiny"), [p + r for p, r in color_facts()])
    watch, counts = Watch(monkeypatch), {}
    lora = dict(peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
                gradient_checkpointing="selective")
    for name, packed, fields in (("unpacked", False, {}), ("packed", True, {}), ("selective", True, lora)):
        before = watch.steps
        (result,) = watch.run(lm_train_spec(store, path, lm_rows(96), batch=4, epochs=1, use_gpu=True,
                                            precision="bf16-mixed", packed=packed, run=f"packed-{name}", **fields))
        assert result.device == "cuda:0" and watch.steps - before >= 20
        counts[name] = (len(watch.syncs), watch.syncs[:5])
    assert counts["packed"][0] <= counts["unpacked"][0], counts
    assert counts["selective"][0] <= counts["unpacked"][0], counts


def test_the_watch_sees_a_sync_where_there_is_one(store, digits, monkeypatch):
    """The check above can fail: a loss read back per step (what the loop must not do) is counted."""
    watch = Watch(monkeypatch)
    original = loop_module.TrainLoop.step

    def reading_step(self):
        original(self)
        torch.zeros(1, device="cuda:0").item()  # a read back each optimizer step

    monkeypatch.setattr(loop_module.TrainLoop, "step", reading_step)
    watch.run(spec_for(store, digits, "reading"))
    # 44 training steps, watched from the second to the last but one: 42 reads (the validation batches, watched
    # too, read nothing: counting them in, the first GPU run asked for 46)
    assert len(watch.syncs) >= 40 > allowed(watch.steps)
