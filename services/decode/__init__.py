"""Decode worker: imports prefilled KV blocks and generates with continuous batching."""
