"""An objective's prepare step (BuiltIn.prepare, estimator.train.loop): it runs before each training and
validation batch's loss, and may generate with the whole model through the strategy (Strategy.generation: DDP's
module unwrapped, FSDP2's units gathered once, not at every generated token), each rank as many tokens as it
wants, without changing what the fit trains. Two ranks, LocalLauncher (no Spark)."""
import json
import os

import pytest
import torch

from lm_helpers import lm_rows, lm_train_spec, plain_causal_lm
from test_lm import llama, lora, tokenizer  # noqa: F401 - the tiny Llama, its tokenizer, the LoRA config

from estimator.launch.local import LocalLauncher
from estimator.train.objectives.tokens import TokenObjective

PROMPT = "What color is the kettle?"


class Sampling(TokenObjective):
    """SFT's loss; before each batch, greedy completions of $SAMPLE_PROMPT's ids, 2 + 2 * rank new tokens (the
    ranks' lengths differ), written with what the module looked like to $SAMPLE_OUT."""

    @classmethod
    def for_rank(cls, spec, objs, model, trainer):
        return cls()

    def prepare(self, generation, batch, ctx):
        prompt = torch.tensor([json.loads(os.environ["SAMPLE_PROMPT"])], device=ctx.device)
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

        gathers, real = [], group.foreach_all_gather  # FSDP2's all-gathers, counted while generating
        with generation() as module:
            seen = {"training": module.training, "grad": torch.is_grad_enabled(), "type": type(module).__name__}
            group.foreach_all_gather = lambda *a, **k: gathers.append(1) or real(*a, **k)
            try:
                ids = module.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                      max_new_tokens=2 + 2 * ctx.rank, min_new_tokens=2 + 2 * ctx.rank)
            finally:
                group.foreach_all_gather = real
        seen["gathers"] = len(gathers)
        units = [m for m in module.modules() if hasattr(m, "_get_fsdp_state")][1:]  # fsdp's, the root's left out
        seen["reshard"] = sorted({m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                                  for m in units})  # each unit's reshard_after_forward, as it is after generating
        name = f"{ctx.rank}-{ctx.epoch}-{'train' if ctx.training else 'val'}-{ctx.batch_idx}.json"
        with open(os.path.join(os.environ["SAMPLE_OUT"], name), "w") as out:
            json.dump({**seen, "ids": ids[0].tolist()}, out)
        return batch


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_prepare_step_generates_with_the_whole_model_and_changes_nothing_trained(llama, tokenizer, store,
                                                                                 tmp_path, monkeypatch, strategy):
    prompt = tokenizer(PROMPT)["input_ids"]
    monkeypatch.setenv("SAMPLE_PROMPT", json.dumps(prompt))
    out = tmp_path / "samples"
    out.mkdir()
    monkeypatch.setenv("SAMPLE_OUT", str(out))
    rows, kw = lm_rows(8), dict(batch=2, epochs=1, peft_config=lora(), strategy=strategy)
    sampled = LocalLauncher().run(lm_train_spec(store, llama, rows, val_rows=lm_rows(6), run="sampled",
                                                objective=Sampling, **kw), 2)
    plain = LocalLauncher().run(lm_train_spec(store, llama, rows, val_rows=lm_rows(6), run="plain", **kw), 2)
    # what the prepare step did not change: the epoch's loss, training and validation (after 2 steps a rank)
    assert [r["loss"] for r in sampled[0].history] == pytest.approx([r["loss"] for r in plain[0].history], rel=1e-6)
    assert [r["val_loss"] for r in sampled[0].history] == pytest.approx([r["val_loss"] for r in plain[0].history],
                                                                        rel=1e-6)
    written = {name: json.load(open(out / name)) for name in os.listdir(out)}
    # every batch: 2 training batches a rank, 2 validation ones (3 rows of each rank's, batch 2)
    assert sorted(written) == sorted(f"{rank}-1-{split}-{i}.json" for rank in (0, 1)
                                     for split, count in (("train", 2), ("val", 2)) for i in range(count))
    assert {(w["training"], w["grad"], w["type"].replace("FSDP", "")) for w in written.values()} == {
        (False, False, "PeftModelForCausalLM")}  # the model itself (fsdp's class is FSDP + its own), in eval mode
    # fsdp: the units gathered once, before generating; none per generated token (21 here without that)
    assert {w["gathers"] for w in written.values()} == {0}
    assert {tuple(w["reshard"]) for w in written.values()} == {(True,) if strategy == "fsdp" else ()}
    # before the first step the weights are the model's as built: a plain generate's greedy tokens, each rank's length
    model = plain_causal_lm(llama, lora()).eval()
    for rank in (0, 1):
        want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=2 + 2 * rank,
                              min_new_tokens=2 + 2 * rank)[0].tolist()
        assert written[f"{rank}-1-train-0.json"]["ids"] == want
