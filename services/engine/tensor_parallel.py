"""Tensor parallelism: one engine's model split over ``--tensor-parallel-size`` processes.

Rank 0 is the engine's own process: it schedules, prepares each step's inputs, samples,
and owns the block pool. Ranks 1..N-1 are processes it starts (``python -m
pdserve.engine.tp_follower``) that hold their shard of the weights and of the KV cache
and follow its commands (``Follower``). Attention heads and the KV cache are split by KV
head, the MLPs (and each expert's MLP) column then row parallel, the embedding and the LM
head by vocabulary; one all-reduce closes the embedding, each attention and each MLP
(``pdserve::tp_all_reduce``, an opaque op: inductor and CUDA graphs see one call).

Two process groups join the ranks: gloo over loopback TCP for the commands and block
bytes (on the host), and on CUDA an NCCL group for the model's collectives (on a CPU the
gloo group does both). A rank that dies breaks every collective of the others: the
followers exit, and rank 0 raises ``RankLost`` (a BaseException: the engine thread
dies, so the worker leaves the registry; ``RankGroup.lost`` tells its watchdog between
steps). Followers set PR_SET_PDEATHSIG, so that they never outlive rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A collective waits this long for its peers before failing (a rank that died fails it
# at once: its sockets close); loading and compiling the model is inside it.
COLLECTIVE_TIMEOUT_S = 600.0
# Followers get this long to leave after the stop command, then are killed.
STOP_GRACE_S = 10.0
LOOPBACK = "127.0.0.1"


class RankLost(BaseException):  # noqa: N818 (a BaseException: the engine thread must end)
    """A tensor-parallel rank died or a collective failed: the engine cannot step again."""


@dataclass(frozen=True)
class Shard:
    """Which part of the model a rank holds: ``rank`` of ``size``; ``group`` is the id of
    its ``RankGroup`` (0: none, a model of one rank)."""

    rank: int = 0
    size: int = 1
    group: int = 0

    def split(self, total: int, what: str) -> int:
        """This rank's part of ``total`` equal parts; ValueError when it does not divide."""
        if total % self.size:
            raise ValueError(
                f"--tensor-parallel-size {self.size} does not divide the model's {what} ({total})"
            )
        return total // self.size

    def range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal part of ``total``."""
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """[start, end) of this rank's rows of the vocabulary: ceil(vocab / size) each, the
        last rank's cut short (its padded rows are zero)."""
        part = -(-vocab // self.size)
        return min(self.rank * part, vocab), min((self.rank + 1) * part, vocab)

    def vocab_part(self, vocab: int) -> int:
        return -(-vocab // self.size)


# The whole model, at one rank.
ONE_RANK = Shard()


def check_divisible(cfg, size: int) -> None:
    """ValueError naming what ``size`` does not divide in the model ``cfg``."""
    shard = Shard(0, size)
    shard.split(cfg.num_heads, "attention heads")
    shard.split(cfg.num_kv_heads, "KV heads")
    shard.split(cfg.intermediate_size, "MLP intermediate size")
    if cfg.is_moe:
        shard.split(cfg.moe_intermediate_size, "expert intermediate size")


# --- the groups -----------------------------------------------------------------------

_GROUPS: dict[int, RankGroup] = {}
_NEXT_GROUP = [1]
_GROUPS_LOCK = threading.Lock()


class RankGroup:
    """The collectives of one tensor-parallel engine, seen from one rank."""

    def __init__(self, rank: int, size: int, port: int, device: torch.device, store=None):
        self.rank = rank
        self.size = size
        self.device = device
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        self.store = store or dist.TCPStore(
            LOOPBACK, port, size, rank == 0, timeout=timeout, wait_for_workers=False
        )
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        options._timeout = timeout
        self.cpu = dist.ProcessGroupGloo(dist.PrefixStore("cpu", self.store), rank, size, options)
        self.model = self.cpu
        if device.type == "cuda":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = timeout
            self.model = dist.ProcessGroupNCCL(
                dist.PrefixStore("nccl", self.store), rank, size, nccl
            )
        self.failure: str | None = None
        with _GROUPS_LOCK:
            self.id = _NEXT_GROUP[0]
            _NEXT_GROUP[0] += 1
            _GROUPS[self.id] = self

    def shard(self) -> Shard:
        return Shard(self.rank, self.size, self.id)

    def _wait(self, work) -> None:
        try:
            work.wait()
        except Exception as error:  # a peer died or timed out: this engine is over
            self.failure = self.failure or f"a tensor-parallel collective failed: {error}"
            raise RankLost(self.failure) from error

    # The model's collectives (on the model group's device).
    def all_reduce(self, x: torch.Tensor) -> None:
        self._wait(self.model.allreduce([x]))

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._wait(self.model.allgather([parts], [x]))
        return parts

    # Host-side messages over gloo.
    def broadcast_object(self, obj: object | None = None) -> object:
        """Rank 0 sends ``obj`` to every rank (``encode``'s kinds of values); each rank
        returns it (its tuples as lists)."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(encode(obj)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self._wait(self.cpu.broadcast([length], dist.BroadcastOptions()))
        if self.rank != 0:
            payload = torch.empty(int(length[0]), dtype=torch.uint8)
        self._wait(self.cpu.broadcast([payload], dist.BroadcastOptions()))
        return obj if self.rank == 0 else decode(payload.numpy().tobytes())

    def send(self, x: torch.Tensor, dst: int) -> None:
        self._wait(self.cpu.send([x.contiguous()], dst, 0))

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        self._wait(self.cpu.recv([x], src, 0))
        return x

    def close(self) -> None:
        with _GROUPS_LOCK:
            _GROUPS.pop(self.id, None)
        for group in {id(self.cpu): self.cpu, id(self.model): self.model}.values():
            with contextlib.suppress(Exception):
                group.shutdown()


def group_of(group_id: int) -> RankGroup:
    return _GROUPS[group_id]


# --- rank 0's messages: JSON and raw arrays, never pickle --------------------------------


def encode(obj: object) -> bytes:
    """``obj`` (None, bools, numbers, strings, lists, tuples, dicts with string keys, numpy
    arrays) as a JSON header, its arrays' bytes after it."""
    arrays: list[np.ndarray] = []

    def walk(x: object) -> object:
        if isinstance(x, np.ndarray):
            arrays.append(np.ascontiguousarray(x))
            return {"array": len(arrays) - 1, "dtype": x.dtype.str, "shape": list(x.shape)}
        if isinstance(x, list | tuple):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {"dict": {str(k): walk(v) for k, v in x.items()}}
        if isinstance(x, np.integer):
            return int(x)
        if x is None or isinstance(x, bool | int | float | str):
            return x
        raise TypeError(f"bug: a tensor-parallel message cannot carry {type(x).__name__}")

    header = json.dumps(walk(obj)).encode()
    return struct.pack("<Q", len(header)) + header + b"".join(a.tobytes() for a in arrays)


def decode(data: bytes) -> object:
    """What ``encode`` wrote."""
    (length,) = struct.unpack_from("<Q", data)
    tree = json.loads(data[8 : 8 + length])
    offset = 8 + length  # the arrays follow in the order the walk meets them

    def walk(x: object) -> object:
        nonlocal offset
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict) and "dict" in x:
            return {k: walk(v) for k, v in x["dict"].items()}
        if isinstance(x, dict):
            dtype = np.dtype(x["dtype"])
            count = int(np.prod(x["shape"], dtype=np.int64))
            array = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
            offset += count * dtype.itemsize
            return array.reshape(x["shape"])
        return x

    return walk(tree)


# --- the model's collective, an opaque op ---------------------------------------------

_lib = torch.library.Library("pdserve", "FRAGMENT")
_lib.define("tp_all_reduce(Tensor x, int group) -> Tensor")


def _tp_all_reduce(x: torch.Tensor, group: int) -> torch.Tensor:
    out = x.clone()
    _GROUPS[group].all_reduce(out)
    return out


_lib.impl("tp_all_reduce", _tp_all_reduce, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::tp_all_reduce")
def _(x, group):
    return torch.empty_like(x)


def all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The sum of ``x`` over the shard's ranks (``x`` itself for a model of one rank)."""
    if shard.size == 1:
        return x
    return torch.ops.pdserve.tp_all_reduce(x, shard.group)


# --- starting the followers -------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """SIGKILL this follower when the thread that started it ends (PR_SET_PDEATHSIG, set
    by the follower itself: a preexec_fn is unsafe in rank 0's threaded process); a parent
    gone before it was set is seen by its pid."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


@dataclass
class FollowerSpec:
    """What a follower needs to build its shard: the engine's settings as rank 0 resolved
    them."""

    args: dict
    model_path: str
    dtype: str
    device: str
    max_model_len: int
    num_blocks: int


class Followers:
    """Ranks 1..N-1 of an engine, as child processes of rank 0."""

    def __init__(self, size: int, spec: FollowerSpec, device: torch.device) -> None:
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        self.store = dist.TCPStore(LOOPBACK, 0, size, True, timeout=timeout, wait_for_workers=False)
        port = self.store.port
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            cmd = [
                sys.executable,
                "-m",
                "pdserve.engine.tp_follower",
                "--rank",
                str(rank),
                "--size",
                str(size),
                "--port",
                str(port),
                "--spec",
                json.dumps(dataclasses.asdict(spec)),
                "--parent",
                str(os.getpid()),
            ]
            self.procs.append(subprocess.Popen(cmd))
        logger.info(
            "tensor parallel: %d ranks, followers pid %s",
            size,
            ", ".join(str(p.pid) for p in self.procs),
        )
        try:
            self._wait_up(size)
            self.group = RankGroup(0, size, port, device, store=self.store)
        except BaseException:
            self.kill()
            raise

    def _wait_up(self, size: int) -> None:
        """Until every follower has reached the store (a follower that exits first, e.g. on
        a bad setting, ends the wait with its status)."""
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        keys = [f"up/{rank}" for rank in range(1, size)]
        while not self.store.check(keys):
            lost = self.lost()
            if lost is not None:
                raise RuntimeError(f"{lost} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks not up in {COLLECTIVE_TIMEOUT_S:g} s")
            time.sleep(0.05)

    def kill(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_GRACE_S)

    def lost(self) -> str | None:
        """Why a follower is gone (its exit status), or None while all run."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {code}"
        return None

    def stop(self, send: bool) -> None:
        """End the followers: the stop command (``send``), then SIGKILL past the grace."""
        if send:
            with contextlib.suppress(RankLost):
                self.group.broadcast_object(("stop",))
        deadline = time.monotonic() + (STOP_GRACE_S if send else 0.0)
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_GRACE_S)
        self.group.close()


# --- a follower's life ------------------------------------------------------------------


def follow(rank: int, size: int, port: int, spec: FollowerSpec) -> int:
    """Build this rank's shard and run rank 0's commands until it says stop."""
    from pdserve.core.model import ModelConfig
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.settings.engine import EngineArgs

    args = EngineArgs(**spec.args)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        LOOPBACK,
        port,
        size,
        False,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        wait_for_workers=False,
    )
    store.set(f"up/{rank}", "1")
    group = RankGroup(rank, size, port, device, store=store)
    cfg = ModelConfig.from_dir(spec.model_path)
    dtype = getattr(torch, spec.dtype)
    runner = ModelRunner(args, cfg, dtype, device, spec.max_model_len, spec.num_blocks, group=group)
    try:
        while True:
            command = group.broadcast_object()
            if command[0] == "stop":
                return 0
            runner.follow(command)
    except RankLost as error:
        logger.error("rank %d: %s; leaving", rank, error)
        return 1
    finally:
        group.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.engine.tp_follower",
        description="One follower rank of a tensor-parallel engine (started by rank 0).",
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--spec", required=True, help="the FollowerSpec as JSON")
    parser.add_argument("--parent", type=int, required=True, help="rank 0's pid")
    opts = parser.parse_args(argv)
    _die_with_parent(opts.parent)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{opts.rank} %(levelname)s %(name)s: %(message)s",
    )
    spec = FollowerSpec(**json.loads(opts.spec))
    if not Path(spec.model_path).is_dir():
        parser.error(f"no model directory {spec.model_path}")
    return follow(opts.rank, opts.size, opts.port, spec)
