"""Accuracy measured: sliding-window perplexity (ppl.py) and KL divergence to the lossless model (kl.py)."""

from tiered.eval.kl import KL, compare, decode_compare, decode_logits, kl_divergence, kl_run, weights_config
from tiered.eval.ppl import Perplexity, Window, default_text_path, perplexity, sliding_windows, text_ids

__all__ = ["KL", "Perplexity", "Window", "compare", "decode_compare", "decode_logits", "default_text_path", "kl_divergence", "kl_run", "perplexity",
           "sliding_windows", "text_ids", "weights_config"]
