"""A tiny causal LM on disk (a Llama config, a byte-level BPE tokenizer trained here, a chat template: the
"pretrained" model of the language-model tests and of notebooks/sft_example.py) and rank-level specs over
prompt/response or chat rows (LocalLauncher, no Spark)."""
import functools
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks"))

from sft_example import CHAT_TEMPLATE, color_facts, save_pretrained_llama  # noqa: E402

__all__ = ["color_facts", "save_pretrained_llama", "lm_rows", "lm_train_spec", "plain_causal_lm"]


def lm_rows(count):
    """(prompt, response) rows whose responses differ in length (a loss averaged per batch would weight them
    differently from one averaged per token)."""
    facts = color_facts()
    out = []
    for i in range(count):
        prompt, response = facts[i % len(facts)]
        out.append((prompt, response + " Really." * (i % 4)))
    return out


def plain_causal_lm(path, peft_config=None, seed=3):
    """What a rank builds: the model from its folder (and the adapters), drawn under the run's seed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    return model


def lm_train_spec(store, path, rows, *, batch, epochs, peft_config=None, lr=1e-2, run="r", chat=False,
                  max_length=None, val_rows=(), packed=False, objective=None, reference_key="pairs-ref",
                  quantization=None, **fields):
    """A TrainSpec over `rows` ((prompt, response) pairs, or chats: lists of messages, or (prompt, chosen,
    rejected) triples with a preference `objective`, whose precomputed reference table is named `reference_key`) in
    the store's Parquet. `quantization`: the factory's quantization_config (the driver then holds the skeleton, as
    fit's does)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from estimator.core.adapters import with_adapters
    from estimator.core.pickling import dumps, user_objects
    from estimator.core.spec import DataSpec, LMSpec, TrainSpec
    from estimator.data.rows import Chat, Pairs, PromptResponse, Prompts
    from estimator.data.parquet import list_pieces
    from estimator.train.objectives.tokens import TokenObjective

    def write(name, part):
        store.makedirs(store.path(name))
        if chat:
            table = pa.table({"chat": pa.array(part, pa.list_(pa.struct([("role", pa.string()),
                                                                         ("content", pa.string())])))})
        elif pairs:
            table = pa.table({"prompt": [p for p, _, _ in part], "chosen": [c for _, c, _ in part],
                              "rejected": [r for _, _, r in part]})
        elif prompts:
            table = pa.table({"prompt": [p for p, _ in part], "answer": [a for _, a in part]})
        else:
            table = pa.table({"prompt": [p for p, _ in part], "response": [r for _, r in part]})
        pq.write_table(table, store.path(name, "part.parquet"), row_group_size=16)
        return list_pieces(store, store.path(name))

    pairs = objective is not None and objective.rows == "preference"  # else an objective of prompt/response rows
    prompts = objective is not None and objective.rows == "prompts"  # (prompt, answer) rows: GRPO's
    train, val = write("train", rows), write("val", val_rows) if val_rows else ()
    stored = pairs and objective.reference_for(peft_config is not None) == "precomputed"
    lm = (LMSpec(Chat("chat"), packed=packed) if chat else LMSpec(Prompts("prompt", ("answer",))) if prompts else
          LMSpec(Pairs("prompt", "chosen", "rejected", reference=reference_key if stored else None),
                 packed=packed) if pairs
          else LMSpec(PromptResponse("prompt", "response"), packed=packed))
    labels = () if chat else ("chosen", "rejected") if pairs else ("answer",) if prompts else ("response",)
    data = DataSpec(store, train, val, (lm.column,), labels, lm=lm, max_length=max_length)
    from estimator.core.recipe import ModelRecipe

    factory = functools.partial(AutoModelForCausalLM.from_pretrained, path,
                                **({"quantization_config": quantization} if quantization is not None else {}))
    driver = (ModelRecipe(factory, peft_config).build(on_meta=True) if quantization is not None
              else with_adapters(factory(), peft_config))
    objs = user_objects(driver, functools.partial(torch.optim.AdamW, lr=lr), [], [],
                        [], model_factory=factory, tokenizer=AutoTokenizer.from_pretrained(path),
                        peft_config=peft_config, objective=objective or TokenObjective)
    fields = {"shuffle": False, **fields}
    return TrainSpec(data, dumps(objs, "model", roots=[factory]), store.run(run), batch, batch, epochs, seed=3,
                     **fields)


def plain_qlora_loop(path, rows, ranks, batch, steps, epochs, lr, peft_config, quantization, out):
    """A plain QLoRA loop as notebooks write it (the base loaded quantized, peft's prepare_model_for_kbit_training,
    get_peft_model), over the steps k ranks of `batch` rows train together, as one batch of k*batch: torch.save
    of {"losses": each epoch's loss over the response tokens, "state": the adapters} to `out`. Run in a process
    of its own (tests/test_qlora.py): peft defines its 4-bit layers at its import only where bitsandbytes is
    importable then."""
    import numpy as np
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from estimator.core.spec import LMSpec
    from estimator.data.lm import IGNORE, CausalLMTokenize
    from estimator.data.rows import PromptResponse

    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization)
    model = get_peft_model(prepare_model_for_kbit_training(model, use_gradient_checkpointing=False), peft_config)
    model.train()  # as a plain loop does (bitsandbytes repacks a 4-bit layer on the CPU at an eval forward)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    tokenize = CausalLMTokenize(tokenizer, LMSpec(PromptResponse("prompt", "response")), None)
    half, losses = len(rows) // ranks, []
    for _ in range(epochs):
        total, tokens = 0.0, 0
        for step in range(steps):  # step s: batch s of every rank, together
            part = [rows[r * half + step * batch + i] for r in range(ranks) for i in range(batch)]
            b = {k: torch.from_numpy(v) for k, v in tokenize({
                "prompt": np.array([p for p, _ in part], dtype=object),
                "response": np.array([r for _, r in part], dtype=object)}).items()}
            loss = model(input_ids=b["prompt.input_ids"], attention_mask=b["prompt.attention_mask"],
                         labels=b["response"]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            count = int((b["response"][:, 1:] != IGNORE).sum())
            total, tokens = total + loss.item() * count, tokens + count
        losses.append(total / tokens)
    state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.save({"losses": losses, "state": state}, out)
