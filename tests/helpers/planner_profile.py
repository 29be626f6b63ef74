"""A planner profile of the tiny test model's workers, for tests that run `pdserve planner`
against a real cluster (made-up costs of the right order: a decision is a few ms)."""

from __future__ import annotations

from pathlib import Path

from pdserve.planner.model import Curve, Profile


def tiny_profile() -> Profile:
    """The tiny model's profile; its name is ``tiny-float32-avx2``."""
    return Profile(
        model="tiny",
        dtype="float32",
        hardware={"class": "avx2", "cores_per_worker": 1, "device": "cpu"},
        prefill=Curve((16.0, 64.0, 256.0), (30.0, 40.0, 80.0)),
        handover=Curve((16.0, 64.0, 256.0), (3.0, 4.0, 8.0)),
        decode=Curve((1.0, 4.0, 16.0), (10.0, 12.0, 20.0)),
        context=64,
        attention_ms_per_token=0.001,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )


def write_tiny_profile(folder: Path) -> Path:
    """``tiny_profile`` saved as ``folder``/profile.json; its path."""
    path = folder / "profile.json"
    tiny_profile().save(path)
    return path
