"""`pdserve profile`: measure what one prefill and one decode worker of a model cost, as
served, on this machine, and save it as the profile `pdserve plan` and the planner read.

It starts a cluster of its own (`pdserve up`: Redis, a kvstore, one prefill and one decode
worker each pinned to --cores-per-worker cores, and a gateway; all confined to those cores)
and measures through the gateway's OpenAI API, as a client would:

1. prefill: prompts of each --prompt-len sent one at a time (a few tokens out): the median
   time to first token; the second token's gap less a decode step is the hand-over;
2. decode: --batch-size requests at once with short prompts: the median gap between tokens
   while all of them are running is the step at that batch;
3. attention: the steps of the prefill runs (batch 1 at each prompt length) and two
   requests of --long-context tokens at once give what a further token of context adds to
   a step.

Each point is measured after a warm-up request of its shape (compilation is not counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from pdserve.planner.model import Curve, Profile, percentile

SHORT_PROMPT = 32  # tokens of the decode measurements' prompts
DECODE_TOKENS = 48  # tokens each decode measurement's requests generate
PREFILL_TOKENS = 16  # tokens each prefill measurement's requests generate


class ProfileError(RuntimeError):
    """The cluster did not start, or a measurement failed; the message says which."""


def hardware(cores: int, device: str = "cpu") -> dict:
    """The machine class a profile holds for: CPU model and vector extensions, cores."""
    model, flags = platform.processor() or "", set()
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
        if m := re.search(r"^model name\s*:\s*(.+)$", text, re.M):
            model = m.group(1).strip()
        if m := re.search(r"^flags\s*:\s*(.+)$", text, re.M):
            flags = set(m.group(1).split())
    if "amx_bf16" in flags:
        cls = "amx"
    elif "avx512_bf16" in flags:
        cls = "avx512bf16"
    elif "avx512f" in flags:
        cls = "avx512"
    elif "avx2" in flags:
        cls = "avx2"
    else:
        cls = platform.machine() or "cpu"
    if device.startswith("cuda"):
        cls = f"cuda-{cls}"
    return {"cpu": model, "class": cls, "cores_per_worker": cores, "device": device}


class _Cluster:
    """`pdserve up` as a child process, confined to ``cpus``; its REST base URL."""

    def __init__(self, argv: list[str], cpus: Sequence[int], log_dir: Path, timeout: float):
        self.log_dir = log_dir
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            process_group=0,
        )
        os.sched_setaffinity(self.proc.pid, set(cpus))
        self.lines: list[str] = []
        self.base_url: str | None = None
        found = threading.Event()

        def read() -> None:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                self.lines.append(line)
                if m := re.match(r"\s*REST\s+(http\S+)/v1$", line):
                    self.base_url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found.wait(0.5):
            if time.monotonic() > deadline:
                self.stop()
                raise ProfileError(f"the cluster was not up within {timeout:.0f} s{self._tail()}")
        if self.base_url is None:
            self.stop()
            raise ProfileError(f"the cluster did not start{self._tail()}")

    def _tail(self) -> str:
        return "\n--- pdserve up ---\n" + "\n".join(self.lines[-20:])

    def log(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.log_dir / f"{name}.log").read_text(errors="replace")
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _records(base_url: str, model: str, sessions, concurrency: int):
    from pdserve.loadgen.client import ClientConfig, run_sessions

    config = ClientConfig(base_url=base_url, model=model, max_concurrency=concurrency)
    result = asyncio.run(run_sessions(config, sessions))
    failed = [r for r in result.records if not r.success]
    if failed:
        raise ProfileError(f"{len(failed)} request(s) failed: {failed[0].error}")
    return result.records


def _steady_gaps(records) -> tuple[list[float], bool]:
    """The gaps between tokens while every request of a batch was running (ms), and whether
    there was such a window (else: every gap after each request's first)."""
    times = []
    for r in records:
        t = r.start + r.ttft
        stamps = [t]
        for gap in r.itl:
            t += gap
            stamps.append(t)
        times.append(stamps)
    start = max(s[1] for s in times if len(s) > 1)  # all have joined the decode batch
    end = min(s[-1] for s in times)  # before the first leaves
    gaps = [
        (b - a) * 1000.0
        for s in times
        for a, b in zip(s[1:], s[2:], strict=False)
        if a >= start and b <= end
    ]
    if len(gaps) < 5:  # no window: every gap after each one's first
        return [g * 1000.0 for r in records for g in r.itl[1:]], False
    return gaps, True


def _least_squares_slope(points: list[tuple[float, float]]) -> float:
    """Slope through the origin of ``points``, not below 0."""
    num = sum(x * y for x, y in points)
    den = sum(x * x for x, _ in points)
    return max(num / den, 0.0) if den else 0.0


def measure(base_url: str, model: str, tokenizer_dir: Path, settings, progress) -> dict:
    """Every measurement against the cluster at ``base_url``; the profile's numbers."""
    from pdserve.loadgen.workloads import WorkloadParams, build_workload, load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    seed = iter(range(1, 1_000_000))

    def sessions(prompt: int, output: int, n: int):
        params = WorkloadParams(random_input_len=prompt, random_output_len=output)
        return build_workload("random", params, tok, n, next(seed))

    lens = sorted({int(v) for v in settings.prompt_lens})
    batches = sorted({int(v) for v in settings.batch_sizes})
    ttft, handover, attention = [], [], []
    for length in lens:
        progress(f"prefill of {length} tokens")
        _records(base_url, model, sessions(length, PREFILL_TOKENS, 1), 1)  # warm-up
        recs = _records(base_url, model, sessions(length, PREFILL_TOKENS, settings.repeats), 1)
        ttft.append(statistics.median(r.ttft * 1000.0 for r in recs))
        # (A chunk of the stream may carry several tokens: the detokenizer holds back an
        # incomplete character.)
        streamed = [r for r in recs if len(r.itl) > 1]
        if not streamed:
            raise ProfileError(f"no stream of a {length}-token prompt had 3 chunks or more")
        step = statistics.median(statistics.median(r.itl[1:]) * 1000.0 for r in streamed)
        first = statistics.median(r.itl[0] * 1000.0 for r in streamed)
        handover.append(max(first - step, 0.0))
        attention.append((length, step))
    decode, ratios = [], []
    for batch in batches:
        progress(f"decode steps at batch {batch}")
        _records(base_url, model, sessions(SHORT_PROMPT, 8, batch), batch)  # warm-up
        recs = _records(base_url, model, sessions(SHORT_PROMPT, DECODE_TOKENS, batch), batch)
        gaps, _ = _steady_gaps(recs)
        step = statistics.median(gaps)
        ratios += [g / step for g in gaps]
        # A larger batch is no cheaper a step: a dip is the measurement's noise.
        decode.append(max(step, decode[-1]) if decode else step)
    context = SHORT_PROMPT + DECODE_TOKENS // 2
    curve = Curve(tuple(map(float, batches)), tuple(decode))
    # Two sequences of --long-context tokens, long enough outputs that the first still runs
    # when the second has been prefilled.
    long_batch = 2
    progress(f"decode steps at batch {long_batch}, {settings.long_context} tokens of context")
    long_out = DECODE_TOKENS * 4
    recs = _records(
        base_url, model, sessions(settings.long_context, long_out, long_batch), long_batch
    )
    gaps, steady = _steady_gaps(recs)
    long_step = statistics.median(gaps)
    # What context beyond the short prompts' adds to a step: batch 1 at each prompt length,
    # and the long pair (where both ran together).
    points = [(max(length - context, 0), step - curve(1)) for length, step in attention]
    if steady:
        extra = long_batch * (settings.long_context + long_out // 2 - context)
        points.append((extra, long_step - curve(long_batch)))
    return {
        "prefill": Curve(tuple(map(float, lens)), tuple(ttft)),
        "handover": Curve(tuple(map(float, lens)), tuple(handover)),
        "decode": curve,
        "context": context,
        "jitter": tuple(percentile(ratios, q) for q in range(0, 101, 5)),
        "attention_ms_per_token": _least_squares_slope(points),
        "points": {
            "attention": [list(p) for p in points],
            "long_context_step_ms": long_step,
            "long_context_batch": long_batch,
        },
    }


def _model_dir(model: str | None) -> Path:
    """``--model``'s directory; the default model is prepared first (in a child process: this
    one loads no engine) if it is not yet."""
    from pdserve.core.model import default_model_dir, is_default_model, is_prepared, locate_model

    if is_default_model(model) and not is_prepared(default_model_dir()):
        argv = [sys.executable, "-m", "pdserve.cli", "prepare-model"]
        if subprocess.run(argv).returncode != 0:
            raise ProfileError("`pdserve prepare-model` failed")
        return default_model_dir()
    return locate_model(model)


def _dtype(cluster: _Cluster, asked: str) -> str:
    if asked != "auto":
        return asked
    m = re.search(r"dtype auto: (\w+)", cluster.log("decode-0"))
    return m.group(1) if m else asked


def main(argv: Sequence[str] | None = None) -> int:
    from pdserve.runtime.logs import configure_logging
    from pdserve.settings.commands import UpSettings
    from pdserve.settings.flags import parse_settings, to_argv
    from pdserve.settings.planner import ProfileSettings

    settings = parse_settings(
        ProfileSettings,
        argv,
        prog="pdserve profile",
        description="Measure one prefill and one decode worker of --model on this machine, "
        "each pinned to --cores-per-worker cores, through a cluster of their own and its "
        "gateway (prefill time by prompt length, decode step time by batch size and "
        "context, the hand-over's time), in a few minutes; save the profile as JSON for "
        "`pdserve plan` and `pdserve planner`. The engine flags are the workers'. Run it "
        "on the kind of machine (or GPU) the workers will run on.",
    )
    configure_logging(settings.log)
    cores = sorted(os.sched_getaffinity(0))
    need = 2 * settings.cores_per_worker
    if len(cores) < need:
        print(
            f"pdserve profile: error: a prefill and a decode worker of {settings.cores_per_worker} "
            f"core(s) each need {need} cores; this process may use {len(cores)}",
            file=sys.stderr,
        )
        return 2
    try:
        model_dir = _model_dir(settings.engine.model)
    except (ValueError, FileNotFoundError, ProfileError) as e:
        print(f"pdserve profile: error: {e}", file=sys.stderr)
        return 2
    engine = dataclasses.replace(
        settings.engine, model=str(model_dir), num_threads=settings.cores_per_worker
    )
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-profile-"))
    up = UpSettings(
        num_prefill=1,
        num_decode=1,
        port=0,
        http_port=0,
        cpu_layout="split",
        log_dir=str(log_dir),
        startup_timeout=settings.startup_timeout,
        engine=engine,
    )
    argv_up = [sys.executable, "-m", "pdserve.cli", "up", *to_argv(up, secrets=False)]
    began = time.monotonic()

    def progress(text: str) -> None:
        print(f"  {text} ({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)

    progress(f"starting a prefill and a decode worker on cores {cores[:need]} (logs: {log_dir})")
    import httpx

    try:
        cluster = _Cluster(argv_up, cores[:need], log_dir, settings.startup_timeout + 60)
        try:
            model = httpx.get(f"{cluster.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
            numbers = measure(cluster.base_url, model, model_dir, settings, progress)
            dtype = _dtype(cluster, settings.engine.dtype)
        finally:
            cluster.stop()
    except (ProfileError, OSError, httpx.HTTPError) as e:
        print(f"pdserve profile: error: {e}", file=sys.stderr)
        return 1
    points = numbers.pop("points")
    profile = Profile(
        model=model_dir.name,
        dtype=dtype,
        hardware=hardware(settings.cores_per_worker, settings.engine.device),
        max_num_seqs=settings.engine.max_num_seqs,
        max_num_batched_tokens=settings.engine.max_num_batched_tokens,
        measured={
            "seconds": round(time.monotonic() - began, 1),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            **points,
        },
        **numbers,
    )
    out = Path(settings.output or f"profile-{profile.name}.json")
    profile.save(out)
    print(_describe(profile))
    print(f"wrote {out}")
    return 0


def _describe(p: Profile) -> str:
    lines = [f"{p.name}: {p.hardware.get('cpu', '')}, {p.hardware['cores_per_worker']} core(s)"]
    lines += [
        f"  prefill   {int(x):>6} tokens: TTFT {y:8.1f} ms, hand-over {h:6.1f} ms"
        for x, y, h in zip(p.prefill.x, p.prefill.y, p.handover.y, strict=True)
    ]
    lines += [
        f"  decode    batch {int(x):>4}: step {y:7.1f} ms"
        for x, y in zip(p.decode.x, p.decode.y, strict=True)
    ]
    lines.append(f"  attention {p.attention_ms_per_token * 1000:.2f} us a token of context a step")
    return "\n".join(lines)
