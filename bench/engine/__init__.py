"""The engine alone, in one process: throughput, step time, speculation, sampling, bf16."""
