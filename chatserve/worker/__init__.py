"""Execution: the model runner, the forward batch, the KV pool and the sampler."""
