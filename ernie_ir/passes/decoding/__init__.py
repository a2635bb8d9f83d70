"""Decoding: the `kv-cache` pass, which turns a graph that computes a whole sequence's logits
into a decoder that reads and returns the attention's keys and values (one graph for prefill and
each step of generation)."""
