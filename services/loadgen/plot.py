"""PNG plots of result files: latency CDFs overlaid, and sweep curves against concurrency."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_CDFS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
_SWEEP_CURVES = (
    ("throughput_vs_concurrency.png", "Output throughput (tok/s)", "output_throughput", None),
    ("tpot_p50_vs_concurrency.png", "TPOT p50 (ms)", "tpot_ms", "p50"),
)


def plot_results(paths: list[Path], out: Path) -> list[Path]:
    """Draw every plot the result files allow into `out`; returns the PNGs written."""
    import matplotlib

    matplotlib.use("Agg")
    results = [(_label(path, result), result) for path, result in map(_load, paths)]
    runs = [series for label, result in results for series in _runs(label, result)]
    sweeps = [(label, result) for label, result in results if result["kind"] == "sweep"]
    out.mkdir(parents=True, exist_ok=True)
    written = [_cdf(out, key, name, runs) for key, name in _CDFS]
    if sweeps:
        written += [_sweep_curve(out, sweeps, *curve) for curve in _SWEEP_CURVES]
    return written


def _load(path: Path) -> tuple[Path, dict]:
    if not path.is_file():
        raise FileNotFoundError(f"result file {path} does not exist")
    result = json.loads(path.read_text())
    if result.get("kind") not in ("serve", "sweep"):
        raise ValueError(f"{path} is not a result of `pdserve bench serve` or `sweep`")
    return path, result


def _label(path: Path, result: dict) -> str:
    return result.get("label") or path.name


def _runs(label: str, result: dict) -> list[tuple[str, dict]]:
    """A serve result as itself; a sweep as its runs, labelled with their concurrency."""
    if result["kind"] == "serve":
        return [(label, result)]
    return [(f"{label} c={run['config']['max_concurrency']}", run) for run in result["runs"]]


def latency_values_ms(run: dict, key: str) -> list[float]:
    """The successful requests' `key` latencies (all ITL gaps pooled), in ms."""
    ok = [r for r in run["requests"] if r["success"]]
    if key == "itl":
        return [gap * 1000 for r in ok for gap in r["itl"]]
    return [r[key] * 1000 for r in ok if r[key] is not None]


def _cdf(out: Path, key: str, name: str, runs: list[tuple[str, dict]]) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, run in runs:
        values = np.sort(latency_values_ms(run, key))
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
    ax.set(xlabel=f"{name} (ms)", ylabel="fraction of requests" if key != "itl" else "fraction")
    ax.set_title(f"{name} CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, out / f"{key}_cdf.png")


def _sweep_curve(
    out: Path, sweeps: list[tuple[str, dict]], file: str, ylabel: str, metric: str, stat: str | None
) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, sweep in sweeps:
        values = [run["metrics"][metric] for run in sweep["runs"]]
        ys = [v[stat] for v in values] if stat else values
        ax.plot(sweep["concurrencies"], ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="max concurrency", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, out / file)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
