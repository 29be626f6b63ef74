"""A NIXL READ between two processes' device memory, against the device's copy bandwidth
measured in the same run (issue 40's GPU check).

The target process registers a tensor of --mib MiB with its NIXL agent (UCX; CUDA memory
on cuda:1 where there are two GPUs, else on cuda:0 beside the reader), the reader one of
the same size, and reads it whole --repeats times; the bytes are checked once. The copy
bandwidth is torch's ``copy_`` between two tensors on the reader's device. ``--device cpu``
runs the same on DRAM (a smoke test for a machine without a GPU).

    python -m bench.gpu.nixl_vram --mib 1024 --out bench/out/nixl_vram.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time


def _agent(name: str):
    from nixl import _api

    config = _api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    return _api.nixl_agent(name, config)


def _tensor(mib: int, device: str, fill: bool):
    import torch

    n = mib * 2**20
    if fill:
        return torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    return torch.zeros(n, dtype=torch.uint8, device=device)


def _mem(device: str) -> tuple[str, int]:
    if device == "cpu":
        return "DRAM", 0
    return "VRAM", int(device.split(":")[1])


def _target(conn, mib: int, device: str) -> None:
    agent = _agent(f"vram-target-{os.getpid()}")
    src = _tensor(mib, device, fill=True)
    agent.register_memory(src)
    conn.send((agent.get_agent_metadata(), src.data_ptr(), int(src.sum().item())))
    while not conn.poll(0.005):
        agent.get_new_notifs()  # progress, as a prefill worker's poller does


def read_between_processes(mib: int, repeats: int, mine: str, theirs: str) -> float:
    """GB/s of one NIXL READ of ``mib`` MiB into this process's memory on ``mine`` from
    another process's on ``theirs`` ("cpu" or "cuda:N"), in one descriptor (the median of
    ``repeats`` after one that warms the connection); the bytes are checked once."""
    ctx = multiprocessing.get_context("spawn")
    ours, other = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(other, mib, theirs))
    proc.start()
    try:
        metadata, address, total = ours.recv()
        agent = _agent(f"vram-reader-{os.getpid()}")
        dst = _tensor(mib, mine, fill=False)
        agent.register_memory(dst)
        remote = agent.add_remote_agent(metadata)
        (kind, dev), (far_kind, far_dev) = _mem(mine), _mem(theirs)
        local = agent.get_xfer_descs([(dst.data_ptr(), dst.numel(), dev)], kind)
        far = agent.get_xfer_descs([(address, dst.numel(), far_dev)], far_kind)
        times = []
        for _ in range(repeats + 1):  # the first warms the connection
            began = time.perf_counter()
            handle = agent.initialize_xfer("READ", local, far, remote)
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            times.append(time.perf_counter() - began)
            agent.release_xfer_handle(handle)
            if state == "ERR":
                raise RuntimeError("the NIXL READ failed")
        assert int(dst.sum().item()) == total, "the bytes read differ from the target's"
    finally:
        ours.send("stop")
        proc.join(60)
    return mib * 2**20 / statistics.median(times[1:]) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if not gpus:
            print("no CUDA device", file=sys.stderr)
            return 2
        mine, theirs = "cuda:0", f"cuda:{1 if gpus > 1 else 0}"
    else:
        mine = theirs = "cpu"
    read_gbps = read_between_processes(args.mib, args.repeats, mine, theirs)
    copy = []
    a = _tensor(args.mib, mine, fill=True)
    b = torch.empty_like(a)
    for _ in range(args.repeats + 1):
        if mine != "cpu":
            torch.cuda.synchronize()
        began = time.perf_counter()
        b.copy_(a)
        if mine != "cpu":
            torch.cuda.synchronize()
        copy.append(time.perf_counter() - began)
    nbytes = args.mib * 2**20
    copy_gbps = nbytes / statistics.median(copy[1:]) / 1e9
    device_name = torch.cuda.get_device_name(0) if mine != "cpu" else "cpu"
    result = {
        "device": device_name,
        "reader": mine,
        "target": theirs,
        "mib": args.mib,
        "nixl_read_gbps": read_gbps,
        "copy_gbps": copy_gbps,
        "of_copy": read_gbps / copy_gbps,
    }
    print(
        f"{device_name}: NIXL READ {theirs} -> {mine}, {args.mib} MiB: {read_gbps:.1f} GB/s; "
        f"device copy {copy_gbps:.1f} GB/s ({read_gbps / copy_gbps:.0%})"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
