"""A "pretrained" text model on disk, built here (no model hub): a WordPiece tokenizer trained with `tokenizers`
and a small BERT from a BertConfig, both saved with save_pretrained; and a generated two-topic text task."""
import os
import random

ANIMALS = "cat dog horse cow sheep goat mouse bird fish duck lion tiger bear wolf fox deer".split()
MACHINES = "car truck engine motor wheel gear piston train plane rocket tractor drill pump valve crane robot".split()
FILLER = "the a one this that big small old new red blue green and with near under over".split()


def topic_texts(rows, seed=0):
    """(text, label) pairs: label 1 when most of the topic words are machines."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        label = rng.randrange(2)
        own, other = (MACHINES, ANIMALS) if label else (ANIMALS, MACHINES)
        words = [rng.choice(own) for _ in range(rng.randint(3, 7))] + [rng.choice(other)]
        words += [rng.choice(FILLER) for _ in range(rng.randint(2, 8))]
        rng.shuffle(words)
        out.append((" ".join(words), label))
    return out


def save_pretrained_bert(folder, texts, hidden=32, layers=2, dropout=0.1):
    """The tokenizer and a BertForSequenceClassification (2 labels, seeded weights) saved to `folder`."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=200, special_tokens=special))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                        model_max_length=64)
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=2, intermediate_size=2 * hidden, max_position_embeddings=64, num_labels=2,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return os.path.abspath(folder)
