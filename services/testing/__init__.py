"""What pdserve's own tests and benchmarks run real clusters with, shipped so that anyone
can: services started as processes and stopped (``cluster``), a cluster under faults
(``chaos``), transformers' greedy output as the reference (``reference``), tiny random
checkpoints (``tiny_models``), an in-process OTLP trace receiver (``otlp_collector``) and
Prometheus text read with prometheus_client's parser (``metrics``).

Nothing in pdserve imports this package; torch and transformers are imported by the
modules that need them (reference, tiny_models)."""
