"""Each row's log-likelihood under a causal LM, for transform's output_kind='score': the log-probabilities of the
row's labelled tokens (the tokens a fit's loss counts: a response and its EOS, every token of a text after the
first and its EOS, each assistant turn) summed, and how many they are. exp(-(sum of the log-probabilities) / (sum
of the tokens)) over a table is then the perplexity a fit's loss reports over the same rows.

Batched by tokens, as embeddings are (estimator.lm.embeddings.token_batches): rows sorted by length, forwards of at
most `batch_size` rows whose rows x longest stays within SCORE_TOKENS, padded on the right (a row's positions and
its tokens' probabilities are then what they are alone). The vocabulary's logits never exist for a whole forward:
where the model's head is found (estimator.lm.chunked_loss.output_head) the forward returns the last hidden states
and the head runs over the labelled positions a chunk at a time, each chunk's log-softmax in float32; otherwise the
model's own logits are read. The sums are kept in float64. torch only, no pyspark."""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np
import torch

from estimator.core.outputs import forward, logits_of
from estimator.data.lm import IGNORE
from estimator.lm.chunked_loss import cast_once, hidden_states, output_head, positions_per_chunk, vocabulary_of
from estimator.lm.embeddings import token_batches
from estimator.lm.logprobs import token_logps

SCORE_TOKENS = 16_384  # rows x their longest row's tokens per forward (as EMBED_TOKENS: 2 CPU cores, a tiny Llama)

Rows = Sequence[Tuple[List[int], List[int]]]  # each row's token ids and labels (IGNORE where not scored)


def score_rows(model: Any, rows: Rows, pad: int, batch_size: int, device: str,
               budget: int = SCORE_TOKENS) -> Tuple[np.ndarray, np.ndarray]:
    """(each row's summed log-probability of its labelled tokens, float64; their count, int64), in the rows'
    order. A row's first token is context only: its label is never scored (nothing predicts it)."""
    logprob, tokens = np.zeros(len(rows), dtype=np.float64), np.zeros(len(rows), dtype=np.int64)
    head, _ = output_head(model)
    with torch.no_grad():  # not inference_mode: the head's input is checked by its version counter
        for part in token_batches([len(ids) for ids, _ in rows], batch_size, budget):
            width = max(max(len(rows[i][0]) for i in part), 1)
            ids = torch.full((len(part), width), pad, dtype=torch.long)
            labels = torch.full((len(part), width), IGNORE, dtype=torch.long)
            mask = torch.zeros((len(part), width), dtype=torch.long)
            for j, i in enumerate(part):
                row_ids, row_labels = rows[i]
                ids[j, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
                labels[j, :len(row_ids)] = torch.tensor(row_labels, dtype=torch.long)
                mask[j, :len(row_ids)] = 1
            batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
            sums = labelled_sums(model, head, batch, labels.to(device))
            logprob[part] = sums.cpu().numpy()
            tokens[part] = (labels[:, 1:] != IGNORE).sum(dim=1).numpy()
    return logprob, tokens


def labelled_sums(model: Any, head: Any, batch: dict, labels: torch.Tensor) -> torch.Tensor:
    """Per row of one padded forward, its labelled tokens' log-probabilities summed (float64)."""
    shape = tuple(labels.shape)
    hidden = hidden_states(model, [batch], head, shape) if head is not None and shape[1] > 1 else None
    if hidden is None:  # no head to run apart (or a forward that changes its output): the model's own logits
        logits = forward(model, [batch])
        logits = logits if isinstance(logits, torch.Tensor) else logits_of(logits)
        values = token_logps(logits, labels).double() * (labels[:, 1:] != IGNORE)
        return values.sum(dim=1)
    target = labels[:, 1:]
    labelled = target != IGNORE
    picked, targets = hidden[:, :-1][labelled], target[labelled]
    row = torch.arange(shape[0], device=labels.device)[:, None].expand_as(target)[labelled]
    values = torch.empty(picked.shape[0], dtype=torch.float64, device=labels.device)
    step = positions_per_chunk(vocabulary_of(head, picked))
    call = cast_once(head, picked.device)
    for start in range(0, picked.shape[0], step):
        logp = torch.log_softmax(call(picked[start:start + step]).float(), dim=-1)
        values[start:start + step] = logp.gather(1, targets[start:start + step, None]).squeeze(1).double()
    return torch.zeros(shape[0], dtype=torch.float64, device=labels.device).index_add_(0, row, values)
