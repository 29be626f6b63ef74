"""A decode worker frees the blocks of a request whose caller went away, within a bound: a
real client process in the middle of a long Decode stream is SIGKILLed (its kernel closes
the connection: gRPC cancels the call at once), or SIGSTOPped (nothing closes: the server's
keepalive ping ends the connection: every 20 s with 10 s to answer by default, here every
2 s with 2 s to answer). Either way the worker's free blocks return to their starting
count well before the request would have finished."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.testing.cluster import decode_idle, decode_stat
from tests.helpers.clusters import running
from tests.helpers.flags import engine_flags

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)

# Long enough that the request runs for minutes if nothing cancels it (SmolLM2 on the CPU).
MAX_TOKENS = 3000
NUM_KV_BLOCKS = 256  # the request needs about 190
KILLED_BOUND_S = 5.0  # the connection closes with the process; the abort waits one step
# The worker's keepalive (grpc_utils): a ping every 2 s, 2 s to answer.
KEEPALIVE_ENV = {"PDSERVE_GRPC_KEEPALIVE_TIME_S": "2", "PDSERVE_GRPC_KEEPALIVE_TIMEOUT_S": "2"}
KEEPALIVE_BOUND_S = 2.0 + 2.0 + 6.0  # keepalive time + timeout, and room for a loaded machine

CLIENT = """
import sys
import grpc
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

channel = grpc.insecure_channel(sys.argv[1])
request = decode_pb2.DecodeRequest(
    request_id=sys.argv[2],
    prompt_token_ids=list(range(100, 150)),
    params=common_pb2.SamplingParams(max_tokens=int(sys.argv[3]), temperature=0, ignore_eos=True),
)
for i, _ in enumerate(decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=600)):
    if i == 2:
        print("STREAMING", flush=True)
"""


@pytest.fixture(scope="module")
def decode(smollm2_path, tmp_path_factory):
    engine = engine_flags(num_kv_blocks=NUM_KV_BLOCKS, max_model_len=4096)
    with running(tmp_path_factory.mktemp("decode-cancel-logs")) as c:
        model = ["--model", str(smollm2_path), *engine]
        yield c, c.start("decode", "pdserve.decode", *model, env=KEEPALIVE_ENV)


@pytest.mark.parametrize(
    ("sig", "bound_s"),
    [(signal.SIGKILL, KILLED_BOUND_S), (signal.SIGSTOP, KEEPALIVE_BOUND_S)],
    ids=["killed", "frozen"],
)
async def test_blocks_of_a_vanished_caller_are_freed_within_the_bound(decode, sig, bound_s):
    cluster, worker = decode
    before = await decode_stat(worker.address)
    assert before.num_free_blocks == before.num_total_blocks == NUM_KV_BLOCKS
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, worker.address, f"vanish-{sig.name}", str(MAX_TOKENS)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(client.stdout.readline), timeout=120)
        assert line.strip() == "STREAMING", line
        during = await decode_stat(worker.address)
        assert during.num_running == 1
        assert during.num_free_blocks < during.num_total_blocks
        client.send_signal(sig)
        await decode_idle(worker.address, bound_s, blocks_free=True)
    finally:
        client.kill()
        client.wait(timeout=10)
        client.stdout.close()
    assert cluster.unhandled_errors() == []
