"""A "pretrained" text model on disk, built here (no model hub), and a generated two-topic text task: the text
example's own (notebooks/text_example.py), so that the tests and the example train on the same thing."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks"))

from text_example import save_pretrained_bert, topic_texts  # noqa: E402

__all__ = ["save_pretrained_bert", "topic_texts"]
