"""`pdserve gateway` as a command: bad flags exit 2 with the check's message; a real process
serves fake workers over gRPC and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.core.tokenizer import Tokenizer
from pdserve.gateway.server import main as gateway_main
from pdserve.runtime.rpc import aio_channel
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.helpers.fake_workers import ANSWER, answer_workers, serving

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prefill", "127.0.0.1:1"], "no decode worker"),
        (["--decode", "127.0.0.1:1"], "needs a prefill worker"),
        (["--decode", "nohost", "--disaggregation", "off"], "not HOST:PORT"),
        (
            ["--decode", "127.0.0.1:1", "--disaggregation", "off", "--decode-timeout", "0"],
            "positive",
        ),
        (["--decode", "127.0.0.1:1", "--disaggregation", "off", "--http-port", "-2"], "-1"),
    ],
)
def test_bad_flags_exit_2(argv, message, capsys, monkeypatch):
    for name in ("PDSERVE_PREFILL_ADDRS", "PDSERVE_DECODE_ADDRS", "PDSERVE_DISAGGREGATION"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as raised:
        gateway_main(argv)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


async def test_process_serves_and_stops_on_sigterm(smollm2_path):
    log, prefill, decode = answer_workers(Tokenizer.from_dir(smollm2_path))
    async with serving(prefill, decode) as (p, d):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pdserve.gateway",
            "--port=0",
            "--http-port=0",
            f"--prefill={p}",
            f"--decode={d}",
            f"--model={smollm2_path}",
            "--log-level=WARNING",
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
        )
        try:
            line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
            assert line.startswith("READY gateway 127.0.0.1:"), line
            channel = aio_channel(line.split()[-1])
            stub = gateway_pb2_grpc.GatewayStub(channel)
            response = await stub.Generate(gateway_pb2.GenerateRequest(prompt="Hi"), timeout=10)
            await channel.close()
            assert response.text == ANSWER
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 15) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
