"""Whole clusters and servers side by side: the comparison with vLLM and transformers, KV
transfer, faults, tracing, start-up and memory, core layouts, speculation under load."""
