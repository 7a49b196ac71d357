"""Sampling: its parameters and the batched sampler."""
