"""``--dtype auto`` on the CPU: the faster of float32 and bfloat16, measured on this machine.

Which dtype is faster is a property of the machine, not of a CPU flag: bf16 GEMMs run
several times faster than fp32 on CPUs with AMX, about as fast or slower on others, and a
step is more than its GEMMs. So the engine's own step is timed in both dtypes (the same
kernels, compiled or not, and thread count the engine will run with): a 256-token prefill
chunk, a decode step of one sequence and one of 16, each at a 256-token context. The
dtype whose step times are lower in geometric mean wins. The result is kept per machine,
model, thread count and step mode under ``$PDSERVE_HOME/probes``, so the probe runs once;
a lock makes workers that start together probe one at a time and share the answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from pdserve.core.model import ModelConfig, pdserve_home
from pdserve.core.sampling import SamplingParams
from pdserve.engine.model import ops
from pdserve.engine.model.cpu_linear import packing_available
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.settings.engine import EngineArgs

logger = logging.getLogger(__name__)

CANDIDATES = ("float32", "bfloat16")
CONTEXT = 256
DECODE_BATCHES = (1, 16)
PROBE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """Step times (seconds) per dtype, and the chosen dtype."""

    dtype: str
    times: dict[str, dict[str, float]]

    def summary(self) -> str:
        parts = []
        for case in next(iter(self.times.values())):
            ms = " vs ".join(f"{self.times[d][case] * 1e3:.1f}" for d in CANDIDATES)
            parts.append(f"{case} {ms} ms")
        return f"{self.dtype} ({' / '.join(CANDIDATES)}: {'; '.join(parts)})"


def cpu_dtype(args: EngineArgs, cfg: ModelConfig) -> str:
    """The dtype ``--dtype auto`` means for this engine on this CPU (probed once)."""
    if not packing_available(torch.bfloat16):
        # No bf16 path in oneDNN here: bf16 linears would be emulated, far slower than fp32.
        logger.info(
            "dtype auto: float32 (oneDNN has no bfloat16 path on this CPU: it needs AVX-512 "
            "or AVX-NE-CONVERT)"
        )
        return "float32"
    path = _result_path(args, cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # workers starting together probe one at a time
        cached = _read(path)
        if cached is not None:
            logger.info("dtype auto: %s, as measured on this machine before", cached.summary())
            return cached.dtype
        logger.info("dtype auto: timing the engine's step in %s once", " and ".join(CANDIDATES))
        result = probe(args, cfg)
        path.write_text(json.dumps(dataclasses.asdict(result), indent=1))
    logger.info("dtype auto: %s, measured now (kept in %s)", result.summary(), path)
    return result.dtype


def probe(args: EngineArgs, cfg: ModelConfig) -> ProbeResult:
    """Time both dtypes' steps on this machine and pick the faster."""
    times = {name: _time_steps(args, cfg, name) for name in CANDIDATES}
    ratio = math.exp(
        statistics.fmean(
            math.log(times["bfloat16"][case] / times["float32"][case]) for case in times["float32"]
        )
    )
    return ProbeResult("bfloat16" if ratio < 1.0 else "float32", times)


def _result_path(args: EngineArgs, cfg: ModelConfig) -> Path:
    key = hashlib.blake2b(digest_size=10)
    for part in (
        PROBE_VERSION,
        platform.processor(),
        _cpu_flags(),
        torch.__version__,
        cfg.fingerprint.hex(),
        torch.get_num_threads(),
        args.enforce_eager,
        args.attention_backend,
        ops.cpu_ops_error() is None,  # the C++ ops, which change what a step costs
    ):
        key.update(str(part).encode())
    return pdserve_home() / "probes" / f"dtype-{key.hexdigest()}.json"


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return platform.machine()


def _read(path: Path) -> ProbeResult | None:
    try:
        data = json.loads(path.read_text())
        return ProbeResult(data["dtype"], data["times"])
    except (OSError, ValueError, KeyError):
        return None


def _time_steps(args: EngineArgs, cfg: ModelConfig, dtype: str) -> dict[str, float]:
    """Median step times of the probe cases, on a runner with a small KV cache."""
    from pdserve.engine.model_runner import ModelRunner

    batch = max(DECODE_BATCHES)
    blocks_per_seq = -(-(CONTEXT + 8) // args.block_size)
    num_blocks = batch * blocks_per_seq + 1
    probe_args = dataclasses.replace(args, max_num_seqs=max(batch, 2))
    # The engine's own max_model_len (its rotary tables' length), so that the model the
    # probe compiles is the one the engine then loads from the compile cache.
    max_model_len = max(cfg.max_model_len(args.max_model_len), CONTEXT + 8)
    runner = ModelRunner(
        probe_args, cfg, getattr(torch, dtype), torch.device("cpu"), max_model_len, num_blocks
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def seqs(n: int) -> list[Sequence]:
        out = []
        for i in range(n):
            s = Sequence(
                f"probe-{i}", [rng.randrange(cfg.vocab_size) for _ in range(CONTEXT)], params
            )
            s.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            out.append(s)
        return out

    def timed(batch: ScheduledBatch, repeats: int) -> float:
        runner.execute(batch)  # warm up
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            runner.execute(batch)
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    result = {}
    prompt = seqs(1)
    result["prefill 256"] = timed(ScheduledBatch(prompt, [CONTEXT]), 3)
    for n in DECODE_BATCHES:
        decoding = seqs(n)
        for s in decoding:
            s.num_computed_tokens = CONTEXT - 1  # the last prompt token is this step's
        result[f"decode {n}"] = timed(ScheduledBatch(decoding, [1] * n), 5)
    return result
