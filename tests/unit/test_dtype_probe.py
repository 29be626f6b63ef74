"""--dtype auto on the CPU: both dtypes timed once, the faster kept, the answer cached."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.core.model import ModelConfig
from pdserve.engine import dtype_probe
from pdserve.settings.engine import EngineArgs


def test_the_probe_times_both_dtypes_and_keeps_its_answer(tiny_llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    # Probed even where oneDNN has no bf16 path (the bf16 runner then runs unpacked).
    monkeypatch.setattr(dtype_probe, "packing_available", lambda dtype: True)
    args = EngineArgs(model=str(tiny_llama_path), enforce_eager=True)
    cfg = ModelConfig.from_dir(tiny_llama_path)
    chosen = dtype_probe.cpu_dtype(args, cfg)
    assert chosen in dtype_probe.CANDIDATES
    (saved,) = (tmp_path / "probes").glob("dtype-*.json")
    data = json.loads(saved.read_text())
    assert data["dtype"] == chosen
    cases = {"prefill 256", "decode 1", "decode 16"}
    assert set(data["times"]) == set(dtype_probe.CANDIDATES)
    assert all(set(t) == cases and min(t.values()) > 0 for t in data["times"].values())

    def no_second_probe(*_):
        raise AssertionError("probed again")

    monkeypatch.setattr(dtype_probe, "probe", no_second_probe)
    assert dtype_probe.cpu_dtype(args, cfg) == chosen
    # Another step mode is another measurement.
    with pytest.raises(AssertionError, match="probed again"):
        dtype_probe.cpu_dtype(EngineArgs(model=str(tiny_llama_path)), cfg)


def test_no_bf16_path_means_float32_without_a_probe(tiny_llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    monkeypatch.setattr(dtype_probe, "packing_available", lambda dtype: dtype != torch.bfloat16)

    def no_probe(*_):
        raise AssertionError("probed")

    monkeypatch.setattr(dtype_probe, "probe", no_probe)
    args = EngineArgs(model=str(tiny_llama_path), enforce_eager=True)
    assert dtype_probe.cpu_dtype(args, ModelConfig.from_dir(tiny_llama_path)) == "float32"
    assert not (tmp_path / "probes").exists()


def test_the_faster_dtype_wins_in_geometric_mean(monkeypatch, tiny_llama_path):
    times = {
        "float32": {"prefill 256": 4.0, "decode 1": 1.0, "decode 16": 2.0},
        "bfloat16": {"prefill 256": 1.0, "decode 1": 1.2, "decode 16": 2.4},
    }
    monkeypatch.setattr(dtype_probe, "_time_steps", lambda args, cfg, name: times[name])
    cfg = ModelConfig.from_dir(tiny_llama_path)
    result = dtype_probe.probe(EngineArgs(), cfg)
    assert result.dtype == "bfloat16"  # 4x on prefill outweighs 1.2x slower decode
    times["bfloat16"]["prefill 256"] = 3.5
    assert dtype_probe.probe(EngineArgs(), cfg).dtype == "float32"
    assert "decode 16 2000.0 vs 2400.0 ms" in result.summary()
