"""A cluster on one machine, as `pdserve up` and `pdserve status` run it: child processes
(``launcher``), their restarts (``supervisor``), a local Redis (``redis_server``) and word of
the running cluster (``cluster_state``). The tests and benchmarks start processes the same way."""
