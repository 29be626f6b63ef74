"""Run vLLM 0.34.0's own OpenAI-server tests against pdserve's gateway.

    .venv/bin/python -m tests.peer.vllm_openai [--keep] [-k EXPR] [--modules PATH ...]
        [--report FILE] [--timeout S] [--workdir DIR] [--collect-only] [-- PYTEST_ARGS]

What it does:

1. Fetches vLLM's source release ``vllm-0.34.0.tar.gz`` from PyPI (the link in
   https://pypi.org/simple/vllm/, its sha256 checked against the index's and the one
   pinned here) into ``bench/out/vllm-peer/`` (gitignored), once.
2. Extracts its ``tests/`` and ``examples/`` (chat templates the tests name) into a work
   directory (``/tmp/pdserve-vllm-peer`` unless ``--workdir``), never vLLM's own package.
3. Lays over it, leaving every test module and its assertions as vLLM wrote them:
   ``tests/utils.py`` (``RemoteOpenAIServer`` starts a pdserve decode worker and a
   colocated gateway: ``tests/peer/vllm_shim/server.py``), ``tests/conftest.py`` (the
   fixtures, without vLLM), and the package ``pdserve_peer_shim`` (``vllm_shim/``): a stub
   ``vllm`` package and a pytest plugin that records each test's outcome. The stub answers
   ``get_tokenizer``, ``ModelConfig(...).get_vocab_size()``, ``current_platform``, ``envs``
   and ``version`` for the model pdserve serves; every other vLLM name is a placeholder
   that raises ``VllmInternalError`` when a test calls it (a unit test of vLLM's internals).
4. Runs pytest there, serially, with a per-test timeout, and writes a JSON report (test id
   -> outcome, phase, error line, a hint) and a markdown summary next to it.

Every server a test asks for serves pdserve's SmolLM2-135M-Instruct (float32, eager) under
the model name the test gives, whatever model vLLM's test names: assertions that depend on
that model's exact output or template then fail ("model-specific"). The ``vllm serve``
flags pdserve has are passed on (``--max-model-len``, ``--served-model-name``,
``--enable-auto-tool-choice``, ``--tool-call-parser``, ``--chat-template``,
``--enable-prompt-tokens-details``, ``--return-tokens-as-token-ids``,
``--enable-tokenizer-info-endpoint``, ``--enable-force-include-usage``, ``--root-path``,
``--max-logprobs`` (capped at pdserve's 20), ``--api-key``/``VLLM_API_KEY``, ``--seed``,
``--host``, ``--port``); the rest are ignored and listed per server in ``<workdir>/logs/servers.log``.

Excluded from the default selection (``tests/entrypoints/openai`` and
``tests/entrypoints/serve``), as out of scope:

- ``openai/responses/``: the Responses API (``/v1/responses``), which pdserve does not serve;
  most of it runs gpt-oss through Harmony.
- ``openai/parser/``: unit tests of vLLM's Harmony parser (no server).
- ``openai/decisions/``: vLLM's ``/v1/decisions`` endpoint, vLLM-only.
- ``openai/correctness/``: lm-evaluation-harness gsm8k accuracy of Qwen2-1.5B (500
  concurrent requests; needs lm_eval and that model).

Processes: each server fixture starts its own cluster and stops it when the fixture ends;
the plugin stops any left at the session's end or on SIGTERM, and this script then looks
for processes carrying this run's token (``PEER_VLLM_RUN``) and kills those by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VERSION = "0.34.0"
SDIST = f"vllm-{VERSION}.tar.gz"
SDIST_SHA256 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
INDEX_URL = "https://pypi.org/simple/vllm/"
CACHE = ROOT / "bench" / "out" / "vllm-peer"
DEFAULT_WORKDIR = Path("/tmp/pdserve-vllm-peer")
DEFAULT_MODULES = ("tests/entrypoints/openai", "tests/entrypoints/serve")
EXCLUDED = (
    "tests/entrypoints/openai/responses",
    "tests/entrypoints/openai/parser",
    "tests/entrypoints/openai/decisions",
    "tests/entrypoints/openai/correctness",
)
PYTEST_INI = """\
[pytest]
markers =
    slow_test
    skip_global_cleanup
    core_model: enable this model test in each PR instead of only nightly
    hybrid_model: models that contain mamba layers
    cpu_model: enable this model test in CPU tests
    cpu_test: mark test as CPU-only test
    split: run this test as part of a split
    distributed: run this test only in distributed GPU tests
    optional: optional tests that are automatically skipped, include --optional to run them
asyncio_mode = strict
asyncio_default_fixture_loop_scope = function
filterwarnings = ignore::DeprecationWarning
"""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sdist_url() -> tuple[str, str]:
    """(URL, sha256) of the sdist, from PyPI's simple index."""
    request = urllib.request.Request(INDEX_URL, headers={"Accept": "text/html"})
    with urllib.request.urlopen(request, timeout=60) as response:
        page = response.read().decode()
    for href in re.findall(r'href="([^"]+)"', page):
        url, _, fragment = href.partition("#")
        if url.rsplit("/", 1)[-1] == SDIST:
            return url, fragment.removeprefix("sha256=")
    raise RuntimeError(f"{SDIST} is not listed in {INDEX_URL}")


def fetch_sdist() -> Path:
    """The verified sdist in the cache, downloaded if it is not there."""
    path = CACHE / SDIST
    if path.exists() and sha256(path) == SDIST_SHA256:
        return path
    url, listed = sdist_url()
    if listed and listed != SDIST_SHA256:
        raise RuntimeError(f"PyPI lists sha256 {listed} for {SDIST}, expected {SDIST_SHA256}")
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    print(f"downloading {url}", flush=True)
    with urllib.request.urlopen(url, timeout=300) as response, open(partial, "wb") as f:
        shutil.copyfileobj(response, f)
    got = sha256(partial)
    if got != SDIST_SHA256:
        partial.unlink()
        raise RuntimeError(f"{SDIST}: sha256 {got}, expected {SDIST_SHA256}")
    partial.rename(path)
    return path


def lay_out(sdist: Path, workdir: Path) -> Path:
    """Extract tests/ and examples/ into ``workdir`` and lay the shim over them; the root."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    prefix = f"vllm-{VERSION}/"
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith((prefix + "tests/", prefix + "examples/"))
        ]
        tar.extractall(workdir, members=members, filter="data")
    root = workdir / f"vllm-{VERSION}"
    shutil.copytree(
        HERE / "vllm_shim",
        root / "pdserve_peer_shim",
        ignore=shutil.ignore_patterns("__pycache__", "overlay"),
    )
    shutil.copy(HERE / "vllm_shim" / "overlay" / "tests_utils.py", root / "tests" / "utils.py")
    shutil.copy(
        HERE / "vllm_shim" / "overlay" / "tests_conftest.py", root / "tests" / "conftest.py"
    )
    (root / "pytest.ini").write_text(PYTEST_INI)
    return root


def served_model() -> str:
    from pdserve.engine.prepare_model import prepare_default_model

    return str(prepare_default_model(progress=False))


def our_leftovers(token: str) -> list[int]:
    """PIDs of live processes whose environment carries this run's token."""
    needle = f"PEER_VLLM_RUN={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def run_pytest(root: Path, args: argparse.Namespace, results: Path, token: str) -> int:
    modules = args.modules or list(DEFAULT_MODULES)
    command = [
        sys.executable,
        "-m",
        "pytest",
        *modules,
        *(f"--ignore={path}" for path in EXCLUDED),
        *("-c", str(root / "pytest.ini"), "--rootdir", str(root)),
        *("-p", "pdserve_peer_shim.plugin", "-p", "no:cacheprovider"),
        *(f"--timeout={args.timeout}", "-rN", "-q", "--color=no"),
        "--continue-on-collection-errors",
    ]
    if args.k:
        command += ["-k", args.k]
    if args.collect_only:
        command.append("--collect-only")
    command += args.pytest_args
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "PEER_VLLM_MODEL": served_model(),
        "PEER_VLLM_LOGS": str(root / "logs"),
        "PEER_VLLM_RESULTS": str(results),
        "PEER_VLLM_VLLM_ROOT": str(root),
        "PEER_VLLM_RUN": token,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    print("$ " + " ".join(command), flush=True)
    proc = subprocess.Popen(command, cwd=root, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
    finally:
        leftovers = our_leftovers(token)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if leftovers:
            print(f"killed {len(leftovers)} leftover process(es): {leftovers}", flush=True)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def summarize(tests: dict[str, dict], duration: float, command: str) -> tuple[dict, str]:
    totals = Counter(entry["outcome"] for entry in tests.values())
    lines = [
        f"# vLLM {VERSION} OpenAI-server tests against pdserve",
        "",
        f"`{command}`: {len(tests)} tests in {duration / 60:.1f} min.",
        "",
        "| outcome | tests |",
        "|---|---|",
        *(f"| {outcome} | {count} |" for outcome, count in sorted(totals.items())),
        "",
        "## By module",
        "",
        "| module | passed | failed | error | skipped |",
        "|---|---|---|---|---|",
    ]
    by_module: dict[str, Counter] = defaultdict(Counter)
    for nodeid, entry in tests.items():
        by_module[module_of(nodeid)][entry["outcome"]] += 1
    for module, counts in sorted(by_module.items()):
        lines.append(
            f"| {module} | {counts['passed']} | {counts['failed']} | {counts['error']} "
            f"| {counts['skipped']} |"
        )
    lines += ["", "## Failures and errors", "", "| test | outcome | hint | message |"]
    lines.append("|---|---|---|---|")
    for nodeid, entry in sorted(tests.items()):
        if entry["outcome"] in ("failed", "error"):
            message = entry.get("message", "").replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(
                f"| `{nodeid}` | {entry['outcome']} ({entry.get('phase', '')}) "
                f"| {entry.get('hint', '')} | {message} |"
            )
    return dict(totals), "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.peer.vllm_openai",
        description="Run vLLM's OpenAI-server tests against pdserve's gateway.",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument(
        "--modules",
        nargs="+",
        help=f"test paths or node ids inside vLLM's tree (default: {' '.join(DEFAULT_MODULES)})",
    )
    parser.add_argument(
        "--report",
        type=Path,
        default=CACHE / "report.json",
        help="the JSON report (the markdown summary goes beside it, .md)",
    )
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    parser.add_argument("--collect-only", action="store_true", help="only collect the tests")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)

    # A SIGTERM (a timeout's, a session's end) stops pytest and its servers as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    root = lay_out(fetch_sdist(), args.workdir.resolve())
    results = root / "results.json"
    token = uuid.uuid4().hex
    started = time.time()
    code = run_pytest(root, args, results, token)
    duration = time.time() - started
    if args.collect_only:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
        return code
    tests = json.loads(results.read_text())["tests"] if results.exists() else {}
    command = "python -m tests.peer.vllm_openai " + " ".join(argv or sys.argv[1:])
    totals, markdown = summarize(tests, duration, command)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "vllm_version": VERSION,
        "command": command,
        "pytest_exit_code": code,
        "duration_s": round(duration, 1),
        "totals": totals,
        "tests": tests,
    }
    args.report.write_text(json.dumps(report, indent=1))
    args.report.with_suffix(".md").write_text(markdown)
    print(f"\n{totals}\nreport: {args.report}\nsummary: {args.report.with_suffix('.md')}")
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    else:
        print(f"work directory kept: {root} (server logs in {root / 'logs'})")
    return 0 if code in (0, 1) else code


if __name__ == "__main__":
    sys.exit(main())
