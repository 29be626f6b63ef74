"""Prefill worker: an engine that computes prompts' KV blocks and ships them to the kvstore."""
