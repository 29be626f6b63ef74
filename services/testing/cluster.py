"""Start pdserve services as real processes on 127.0.0.1 for tests, and stop them (by PID),
with the one launcher `pdserve up` uses."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from pdserve.local.launcher import Child, Launcher
from pdserve.runtime.rpc import aio_channel
from pdserve.v1 import decode_pb2, decode_pb2_grpc


class Cluster:
    """Processes started by a test, stopped at the end."""

    def __init__(self, log_dir: Path) -> None:
        env = {
            **os.environ,
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"),
            # A gateway's REST API on any free port, so that several gateways can run.
            "PDSERVE_HTTP_PORT": os.environ.get("PDSERVE_HTTP_PORT", "0"),
            # Workers run the plain model: these tests are about the services, and each
            # compiled start costs seconds. The compiled step has its own exactness tests
            # (test_exactness_*), and test_up runs it through a real cluster.
            "PDSERVE_ENFORCE_EAGER": os.environ.get("PDSERVE_ENFORCE_EAGER", "1"),
        }
        self.launcher = Launcher(log_dir, env=env)

    @property
    def services(self) -> list[Child]:
        return self.launcher.children

    def start(
        self,
        name: str,
        module: str,
        *args: str,
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
        ready: tuple[str, ...] = (),
    ) -> Child:
        """Run ``python -m module --port 0 args...`` (``env`` added to its environment) and
        wait for its READY line(s): a gateway also owes ``READY gateway-http`` unless its
        REST API is off; ``ready``: more to wait for (e.g. "decode-metrics")."""
        argv, expect = self._command(module, args, ready)
        return self.launcher.start_ready(name, argv, expect, timeout=timeout, env=env)

    def start_many(
        self,
        *specs: tuple[str, ...],
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
        ready: dict[str, tuple[str, ...]] | None = None,
    ) -> list[Child]:
        """``start`` each ``(name, module, *args)`` at once and wait for them all: their
        imports and model loads overlap. A spec may end with a dict: its own environment,
        added to ``env``. ``ready``: more READY lines to wait for, by name. A failure stops
        those it started."""
        children = []
        try:
            for name, module, *args in specs:
                own = args.pop() if args and isinstance(args[-1], dict) else {}
                argv, expect = self._command(module, tuple(args), (ready or {}).get(name, ()))
                children.append(self.launcher.start(name, argv, expect, env={**(env or {}), **own}))
            self.launcher.wait_ready(children, timeout)
        except BaseException:
            self.launcher.stop(children)
            raise
        return children

    @staticmethod
    def _command(module: str, args: tuple[str, ...], ready: tuple[str, ...]):
        expect = [module.rsplit(".", 1)[-1].replace("_", "-")]
        if expect == ["gateway"] and not _rest_off(args):
            expect.append("gateway-http")
        expect += ready
        return [sys.executable, "-m", module, "--port", "0", *args], expect

    def address(self, name: str) -> str:
        """The address of the started service called ``name``."""
        return next(s.address for s in self.services if s.name == name)

    def stop(self, svc: Child, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Send ``sig``, wait up to ``timeout`` s (then SIGKILL); its exit code."""
        self.launcher.stop([svc], timeout, sig)
        return svc.proc.returncode

    def stop_all(self) -> None:
        self.launcher.stop_all()

    def unhandled_errors(self) -> list[str]:
        """Log lines of every service that show an unhandled exception."""
        bad = []
        for svc in self.services:
            for line in svc.log_text().splitlines():
                if "Traceback" in line or "Exception in callback" in line or "Unhandled" in line:
                    bad.append(f"{svc.name}: {line}")
        return bad


def _rest_off(args: tuple[str, ...]) -> bool:
    joined = " ".join(args)
    return "--http-port -1" in joined or "--http-port=-1" in joined


async def decode_stat(address: str) -> decode_pb2.DecodeStatResponse:
    """A decode worker's Stat."""
    async with aio_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        return await stub.Stat(decode_pb2.DecodeStatRequest(), timeout=10)


async def decode_idle(
    address: str, within_s: float, blocks_free: bool = False
) -> decode_pb2.DecodeStatResponse:
    """A decode worker's Stat once nothing runs or waits (and, with ``blocks_free``, every
    KV block is free); AssertionError if that takes over ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        s = await decode_stat(address)
        idle = s.num_running == 0 and s.num_waiting == 0
        if idle and (not blocks_free or s.num_free_blocks == s.num_total_blocks):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"decode worker {address} not idle within {within_s} s: {s}")
        await asyncio.sleep(0.1)
