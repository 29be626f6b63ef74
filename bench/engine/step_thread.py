"""The engine's decode step on the thread that built the engine against another thread.

    .venv/bin/python -m bench.engine.step_thread [--dtype bfloat16] [--batches 1,16]

libgomp keeps a pool of OpenMP worker threads for every thread that has opened a parallel
region, and once a process holds more OpenMP threads than cores it stops spinning between
regions (each region then waits on futex wake-ups). One process per variant (SmolLM2, warm
compile cache assumed), each deciding B prompts of 256 tokens for 48 tokens and taking the
median of the last 40 steps, three repeats (their median):

- ``built here``: the engine is built and stepped on the main thread (``LLM``, the
  offline API);
- ``stepped on another thread``: built on the main thread, stepped on a second one (the
  workers before their engine was built on the engine thread);
- ``AsyncEngine``: ``AsyncEngine(builder)`` as the workers run it, the step timed on its
  engine thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading

from bench import ROOT
from bench.engine.step_time import decode_step_ms

VARIANTS = ("built here", "stepped on another thread", "AsyncEngine")


def _child(variant: str, dtype: str, batches: list[int]) -> dict[int, float]:
    from pdserve.core.model import locate_model
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.engine.engine import LLMEngine
    from pdserve.settings.engine import EngineArgs

    model = str(locate_model(None))
    args = EngineArgs(model=model, dtype=dtype)
    if variant == "AsyncEngine":
        engine = AsyncEngine(lambda: LLMEngine(args, model))

        async def run() -> dict[int, float]:
            return await engine.call(lambda e: decode_step_ms(e, batches))

        result = asyncio.run(run())
        engine.shutdown()
        return result
    built = LLMEngine(args, model)
    if variant == "built here":
        return decode_step_ms(built, batches)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(r=decode_step_ms(built, batches)))
    thread.start()
    thread.join()
    return box["r"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(_child(args.child, args.dtype, batches)))
        return
    rows = {}
    for variant in VARIANTS:
        argv = [sys.executable, "-m", "bench.engine.step_thread", "--child", variant]
        argv += ["--dtype", args.dtype]
        out = subprocess.run(
            [*argv, "--batches", args.batches], cwd=ROOT, capture_output=True, text=True
        )
        if out.returncode != 0:
            sys.exit(f"{variant}: failed\n{out.stderr[-2000:]}")
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"| variant | {' | '.join(f'batch {b} step ms' for b in batches)} |")
    print(f"|---|{'---|' * len(batches)}")
    for variant, times in rows.items():
        print(f"| {variant} | {' | '.join(f'{times[str(b)]:.1f}' for b in batches)} |")


if __name__ == "__main__":
    main()
