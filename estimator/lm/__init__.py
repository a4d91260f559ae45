"""The language-model module: what training and transform both do with a causal LM's tokens, in torch and
transformers only (no pyspark, nothing of train/ or predict/, which both import it):

- generation: generate() over batches sorted by length and bounded by tokens, and embeddings pooled over the
  attention mask (transform's output kinds 'generate' and 'embedding');
- logprobs: each row's answer scored, its labelled tokens' log-probabilities summed (DPO, a score);
- chunked_loss: the next-token loss without the vocabulary's logits in float32;
- packed_attention: a packed batch's rows attending each to itself only.

The rows' tokenization (prompts and responses, chats, packing) is the data path's: estimator.data.lm."""
