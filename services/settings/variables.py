"""The ``PDSERVE_*`` variables that are not flags, each named and explained once.

Every flag has its own variable (``--max-num-seqs`` is ``PDSERVE_MAX_NUM_SEQS``,
``flags.env_names``); these few act where no flag reaches: a process-wide knob of the gRPC
layer, the CPU kernels' choices kept for comparisons, test-only fault injection. A
``PDSERVE_*`` variable that is neither a flag's nor here is warned about at start
(``commands.known_env``), and a test checks that every name the code reads is known.
"""

from __future__ import annotations

GRPC_KEEPALIVE_TIME = "PDSERVE_GRPC_KEEPALIVE_TIME_S"
GRPC_KEEPALIVE_TIMEOUT = "PDSERVE_GRPC_KEEPALIVE_TIMEOUT_S"
CPU_OPS = "PDSERVE_CPU_OPS"
CPU_SGEMM = "PDSERVE_CPU_SGEMM"
TEST_FAULT = "PDSERVE_TEST_FAULT"

# name -> what it does (docs/configuration.md is generated from this and the flags)
VARIABLES: dict[str, str] = {
    GRPC_KEEPALIVE_TIME: "seconds between keepalive pings on every gRPC server and channel "
    "of the process (default 20): a peer that stops answering is cut off within time + timeout",
    GRPC_KEEPALIVE_TIMEOUT: "seconds a keepalive ping may go unanswered (default 10)",
    CPU_OPS: "`python`: run the CPU step's attention and linears as Python custom ops instead "
    "of the C++ operators (for comparisons)",
    CPU_SGEMM: "`0`: float32 linears through oneDNN instead of the AVX2 sgemm kernel (for "
    "comparisons)",
    TEST_FAULT: "test-only fault injection of a worker's engine (pdserve.worker.faults), e.g. "
    "`engine-thread-death-after:N`",
}
