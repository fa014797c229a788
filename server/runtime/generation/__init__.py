"""Generative decoding: a decoder's key/value cache held on the server per sequence, and every running
sequence decoded one step at a time as one batch (continuous batching)."""
