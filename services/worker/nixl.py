"""KV blocks over NIXL: the decode worker reads a prompt's blocks straight from the prefill
worker's memory (``--kv-transport nixl``).

Each worker has one NIXL agent (UCX underneath: shared memory or ``process_vm_readv`` on
one host, RDMA or TCP between hosts) and one buffer of block slots registered with it
(``--nixl-buffer-bytes``):

- the prefill worker copies a prompt's exported blocks into slots held under a lease
  (``stage``), answers with their addresses and checksums (``NixlSource`` on the wire),
  and frees the slots when the decode worker's read completes (its agent sends the lease
  name as a NIXL notification, ``poll``) or after ``LEASE_S``;
- the decode worker finds the prefill worker's agent metadata in its registry entry (a
  worker reads only from peers the registry lists: entries are signed under the internal
  token), reads the blocks it lacks into its own slots (``read``), checks each one's
  checksum, and frees the slots once the engine has imported them.

Anything that fails (no slot free, the peer gone, a read past its deadline, a checksum)
costs a fallback to the kvstore, else a recompute, never the request. Every call on the
agent runs on one thread of its own, off the event loop and the engine thread.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.core.errors import SettingsError
from pdserve.kv.blocks import FetchedBlocks, block_checksum

logger = logging.getLogger(__name__)

LEASE_S = 60.0  # a staged block waits this long for its read
EXTRA = "pip install 'pdserve[nixl]'"


class NixlUnavailable(RuntimeError):
    """NIXL cannot be used in this process (not installed, no UCX backend)."""


def load_nixl():
    """NIXL's agent API (``nixl._api``), or NixlUnavailable saying why."""
    try:
        from nixl import _api
    except Exception as e:  # noqa: BLE001 (an ImportError, or a library that fails to load)
        raise NixlUnavailable(f"the nixl package does not load ({e}); {EXTRA}") from None
    return _api


class SlotPool:
    """Slot numbers handed out under named leases; a lease ends when released or expired.
    Thread-safe: a decode worker's slots are freed on its engine thread, after the import."""

    def __init__(self, num_slots: int, lease_s: float | None = None, clock=time.monotonic) -> None:
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self.lease_s = lease_s
        self._clock = clock
        self._leases: OrderedDict[str, tuple[list[int], float]] = OrderedDict()
        self.expired = 0
        self._lock = threading.RLock()

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def take(self, n: int, lease: str) -> list[int] | None:
        """``n`` slots held under ``lease``; None (nothing taken) when too few are free."""
        with self._lock:
            self.expire()
            if n > len(self.free_slots) or lease in self._leases:
                return None
            slots = [self.free_slots.pop() for _ in range(n)]
            until = self._clock() + self.lease_s if self.lease_s else float("inf")
            self._leases[lease] = (slots, until)
            return slots

    def release(self, lease: str) -> int:
        """Give ``lease``'s slots back; how many (0: no such lease, or ended already)."""
        with self._lock:
            held = self._leases.pop(lease, None)
            if held is None:
                return 0
            self.free_slots.extend(reversed(held[0]))
            return len(held[0])

    def expire(self) -> int:
        """End the leases whose time is up; how many."""
        with self._lock:
            now, ended = self._clock(), 0
            while self._leases:
                lease, (_, until) = next(iter(self._leases.items()))
                if until > now:
                    break
                self.release(lease)
                ended += 1
            self.expired += ended
            return ended


@dataclass
class Staged:
    """Blocks a prefill worker staged for one decode worker's read."""

    lease: str
    addresses: list[int]
    checksums: list[int]


@dataclass
class NixlCounters:
    staged_blocks: int = 0
    staged_bytes: int = 0
    stage_full: int = 0  # requests that found too few free slots (they went by gRPC)
    read_blocks: int = 0
    read_bytes: int = 0
    read_failures: int = 0
    released: int = 0  # leases ended by their reader's notification


class NixlEndpoint:
    """A worker's NIXL agent and its registered slots of ``block_bytes`` each."""

    def __init__(self, name: str, buffer_bytes: int, block_bytes: int) -> None:
        api = load_nixl()
        self.name = name
        self.block_bytes = block_bytes
        num_slots = buffer_bytes // block_bytes
        if num_slots < 1:
            raise NixlUnavailable(
                f"--nixl-buffer-bytes {buffer_bytes} holds no block of {block_bytes} bytes"
            )
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl")
        try:
            # No progress thread: it spins a core while idle. Transfers progress as
            # they are polled (check_xfer_state), notifications as they are read.
            config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self.agent = api.nixl_agent(name, config)
        except Exception as e:  # noqa: BLE001 (the UCX backend refused: no transport)
            self._thread.shutdown()
            raise NixlUnavailable(f"NIXL's UCX backend did not start: {e}") from None
        if "UCX" not in getattr(self.agent, "backends", {"UCX": None}):
            self._thread.shutdown()
            raise NixlUnavailable("NIXL has no UCX backend here")
        # Pages are touched as slots are first used, not all at once.
        self.buffer = torch.empty(num_slots, block_bytes, dtype=torch.uint8)
        self._registered = self.agent.register_memory(self.buffer)
        self.base = self.buffer.data_ptr()
        self.slots = SlotPool(num_slots, LEASE_S)
        self.counters = NixlCounters()
        self._remote: dict[str, tuple[bytes, str]] = {}  # worker id -> (metadata, agent)

    # --- what the registry carries ------------------------------------------------------

    def metadata(self) -> str:
        """This agent's metadata (base64), for its registry entry."""
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def entry_fields(self) -> dict:
        return {"nixl_agent": self.name, "nixl_metadata": self.metadata()}

    async def _run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def close(self) -> None:
        self._thread.submit(self._close).result(timeout=10)
        self._thread.shutdown()

    def _close(self) -> None:
        for worker_id in list(self._remote):
            self._forget(worker_id)
        try:
            self.agent.deregister_memory(self._registered)
        except Exception as e:  # noqa: BLE001 (leaving anyway)
            logger.debug("NIXL deregister: %s", e)

    # --- the prefill side -------------------------------------------------------------

    async def stage(self, lease: str, blocks: Sequence) -> Staged | None:
        """Copy ``blocks`` (ExportedBlock: key, data, num_tokens) into slots held under
        ``lease``, with their checksums; None when too few slots are free."""
        slots = self.slots.take(len(blocks), lease)
        if slots is None:
            self.counters.stage_full += 1
            return None
        try:
            checksums = await _split(self._copy_in, slots, blocks)
        except BaseException:
            self.slots.release(lease)
            raise
        self.counters.staged_blocks += len(blocks)
        self.counters.staged_bytes += len(blocks) * self.block_bytes
        return Staged(lease, [self.base + s * self.block_bytes for s in slots], checksums)

    def _copy_in(self, slots: list[int], blocks: Sequence) -> list[int]:
        sums = []
        for slot, b in zip(slots, blocks, strict=True):
            row = self.buffer[slot]
            with warnings.catch_warnings():  # read only: an exported block's bytes
                warnings.simplefilter("ignore", UserWarning)
                row.copy_(torch.frombuffer(b.data, dtype=torch.uint8))
            sums.append(block_checksum(b.key, b.num_tokens, row.numpy()))
        return sums

    async def poll(self) -> int:
        """Free the slots of leases whose reader said it is done, and the expired; how many
        leases ended."""
        notes = await self._run(self.agent.get_new_notifs)
        ended = 0
        for messages in notes.values():
            for message in messages:
                ended += bool(self.slots.release(bytes(message).decode(errors="replace")))
        self.counters.released += ended
        return ended + self.slots.expire()

    # --- the decode side --------------------------------------------------------------

    async def read(
        self,
        worker_id: str,
        agent_name: str,
        metadata: str,
        lease: str,
        wanted: Sequence[tuple[bytes, int, int, int]],
        timeout_s: float,
    ) -> FetchedBlocks:
        """The blocks ``wanted`` ((key, remote address, checksum, num_tokens) each) read from
        the agent of ``worker_id``, each checked against its checksum. ``found`` holds views
        of this endpoint's slots: ``done()`` on the result frees them. Raises
        NixlReadError when the read fails or passes ``timeout_s``."""
        fetched = FetchedBlocks()
        if not wanted:  # this worker's cache held them all: the peer's slots are free
            await self._run(self._notify, worker_id, agent_name, metadata, lease)
            return fetched
        local_lease = f"read/{lease}/{time.monotonic_ns()}"
        slots = self.slots.take(len(wanted), local_lease)
        if slots is None:
            raise NixlReadError(f"{len(wanted)} blocks do not fit in --nixl-buffer-bytes now")
        try:
            await self._run(
                self._read, worker_id, agent_name, metadata, lease, wanted, slots, timeout_s
            )
            rows = [self.buffer[s].numpy() for s in slots]
            ok = await _split(_check, wanted, rows)
        except BaseException:
            self.slots.release(local_lease)
            self.counters.read_failures += 1
            raise
        for (key, *_), row, good in zip(wanted, rows, ok, strict=True):
            if good:
                fetched.found[key] = memoryview(row)
            else:
                fetched.rejected[key] = "checksum differs from the prefill worker's (NIXL read)"
        self.counters.read_blocks += len(fetched.found)
        self.counters.read_bytes += len(fetched.found) * self.block_bytes
        fetched.on_done(lambda: self.slots.release(local_lease))
        return fetched

    def _read(self, worker_id, agent_name, metadata, lease, wanted, slots, timeout_s) -> None:
        try:
            self._read_or_raise(worker_id, agent_name, metadata, lease, wanted, slots, timeout_s)
        except NixlReadError:
            raise
        except Exception as e:  # noqa: BLE001 (NIXL's errors: a peer gone, refused, ...)
            self._forget(worker_id)
            raise NixlReadError(f"{type(e).__name__}: {e}") from None

    def _read_or_raise(
        self, worker_id, agent_name, metadata, lease, wanted, slots, timeout_s
    ) -> None:
        remote = self._peer(worker_id, agent_name, metadata)
        bb = self.block_bytes
        pairs = coalesce(
            [(self.base + s * bb, w[1]) for s, w in zip(slots, wanted, strict=True)], bb
        )
        local = self.agent.get_xfer_descs([(mine, n, 0) for mine, _, n in pairs], "DRAM")
        theirs = self.agent.get_xfer_descs([(peer, n, 0) for _, peer, n in pairs], "DRAM")
        handle = self.agent.initialize_xfer("READ", local, theirs, remote, lease.encode())
        deadline = time.monotonic() + timeout_s
        try:
            state = self.agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise NixlReadError(f"the read passed its {timeout_s:g} s deadline")
                time.sleep(0.0002)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise NixlReadError("the transfer failed")
        except NixlReadError:
            self._forget(worker_id)  # a dead or restarted peer: its metadata again next time
            raise
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as e:  # noqa: BLE001 (a handle still in flight after an error)
                logger.debug("NIXL release of a transfer handle: %s", e)

    def _notify(self, worker_id: str, agent_name: str, metadata: str, lease: str) -> None:
        try:
            self.agent.send_notif(self._peer(worker_id, agent_name, metadata), lease.encode())
        except Exception as e:  # noqa: BLE001 (the peer's lease ends by itself)
            logger.debug("NIXL notification to %s: %s", worker_id, e)

    def _peer(self, worker_id: str, agent_name: str, metadata: str) -> str:
        """The remote agent's name, its metadata loaded (again, when it changed)."""
        raw = base64.b64decode(metadata)
        held = self._remote.get(worker_id)
        if held is not None and held[0] == raw:
            return held[1]
        if held is not None:
            self._forget(worker_id)
        name = self.agent.add_remote_agent(raw)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != agent_name:
            self.agent.remove_remote_agent(name)
            raise NixlReadError(
                f"worker {worker_id}'s NIXL metadata names agent {name!r}, not {agent_name!r}"
            )
        self._remote[worker_id] = (raw, name)
        return name

    def _forget(self, worker_id: str) -> None:
        held = self._remote.pop(worker_id, None)
        if held is not None:
            try:
                self.agent.remove_remote_agent(held[1])
            except Exception as e:  # noqa: BLE001
                logger.debug("NIXL remove_remote_agent: %s", e)


def coalesce(pairs: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int, int]]:
    """(local, remote, length) runs of ``size``-byte block copies ``(local, remote)``: a
    block that follows the previous one on both sides extends its run (slots taken
    together are mostly consecutive), so a read has a few descriptors, not one a block."""
    runs: list[list[int]] = []
    for mine, peer in pairs:
        if runs and runs[-1][0] + runs[-1][2] == mine and runs[-1][1] + runs[-1][2] == peer:
            runs[-1][2] += size
        else:
            runs.append([mine, peer, size])
    return [tuple(run) for run in runs]


def _check(wanted: Sequence, rows: Sequence) -> list[bool]:
    return [
        block_checksum(key, n, row) == crc
        for (key, _, crc, n), row in zip(wanted, rows, strict=True)
    ]


async def _split(fn: Callable, a: Sequence, b: Sequence) -> list:
    """``fn(a, b)`` on two threads, each half of both lists (zlib's CRC and torch's copy
    let go of the GIL): a block's CRC runs at ~2-4 GB/s on one core."""
    if len(a) < 8:
        return await asyncio.to_thread(fn, a, b)
    half = len(a) // 2
    first, second = await asyncio.gather(
        asyncio.to_thread(fn, a[:half], b[:half]), asyncio.to_thread(fn, a[half:], b[half:])
    )
    return first + second


class NixlReadError(RuntimeError):
    """A NIXL read that did not complete: its blocks come from the kvstore or are
    recomputed."""


def open_endpoint(
    role: str, transport, layout, worker_id: str, has_registry: bool, resources
) -> NixlEndpoint | None:
    """The worker's NIXL endpoint under ``--kv-transport`` (``transport``:
    KVTransportSettings), or None for gRPC; the choice is logged once. ``nixl`` that cannot
    be had stops the start (SettingsError: exit 2); ``auto`` falls back to gRPC."""
    mode = transport.kv_transport
    if mode == "grpc":
        logger.info("%s: KV transport grpc, through the kvstore (--kv-transport grpc)", role)
        return None
    try:
        if not has_registry:
            raise NixlUnavailable(
                "workers find each other's NIXL agents in the registry, and --redis-url is not set"
            )
        endpoint = NixlEndpoint(worker_id, transport.nixl_buffer_size, layout.block_bytes)
    except NixlUnavailable as e:
        if mode == "nixl":
            raise SettingsError(f"--kv-transport nixl: {e}") from None
        logger.warning("%s: KV transport grpc, through the kvstore: %s", role, e)
        return None
    resources.callback(endpoint.close)
    logger.info(
        "%s: KV transport nixl (agent %s, UCX; %d slots of %d bytes registered), the "
        "kvstore as fallback",
        role,
        endpoint.name,
        endpoint.slots.num_free,
        endpoint.block_bytes,
    )
    return endpoint
