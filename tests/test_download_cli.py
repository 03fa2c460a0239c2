"""`ringserve download` as a real subprocess: the folder path last on stdout, progress on stderr,
and bad input as one `error:` line with exit status 1, never a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringserve.gpu.loader.model_store import CONVERTER_VERSION
from ringserve.tools.tiny_gguf import make_tiny_gguf

FIVE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json")


def download(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if cache is not None:
        env["RINGSERVE_CACHE"] = str(cache)
    return subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "download", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def folder_printed(done: subprocess.CompletedProcess) -> Path:
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert all((path / f).is_file() for f in FIVE_FILES)
    return path


@pytest.mark.slow
def test_default_model(default_model_dir):
    done = download()
    assert folder_printed(done) == default_model_dir
    assert done.stdout == f"{default_model_dir}\n"  # progress goes to stderr only
    assert folder_printed(download("SmolLM2-135M-Instruct")) == default_model_dir


def test_gguf_file_is_converted_once(tmp_path):
    make_tiny_gguf(tmp_path / "tiny.gguf", num_layers=1)
    first = download(str(tmp_path / "tiny.gguf"), cache=tmp_path / "cache")
    path = folder_printed(first)
    assert path.parents[1] == tmp_path / "cache" / "models" / f"v{CONVERTER_VERSION}" / "gguf"
    assert path.name == "tiny"  # the file's stem: the model's served name
    assert "converting tiny.gguf" in first.stderr
    stamp = (path / "model.safetensors").stat().st_mtime_ns

    second = download(str(tmp_path / "tiny.gguf"), cache=tmp_path / "cache")
    assert folder_printed(second) == path and second.stderr == ""
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert folder_printed(download(str(path), cache=tmp_path / "cache")) == path  # an HF folder is itself


def bad_inputs(tmp: Path) -> dict[str, tuple[str, str]]:
    """name -> (argument, what the error line says)"""
    make_tiny_gguf(tmp / "gpt2.gguf", arch="gpt2", num_layers=1)
    make_tiny_gguf(tmp / "f64.gguf", num_layers=1, type_overrides={"ffn_up.weight": "F64"})
    make_tiny_gguf(tmp / "whole.gguf", num_layers=1)
    data = (tmp / "whole.gguf").read_bytes()
    (tmp / "truncated.gguf").write_bytes(data[: len(data) * 2 // 3])
    (tmp / "corrupt.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4)
    (tmp / "empty-folder").mkdir()
    return {
        "missing file": (str(tmp / "missing.gguf"), f"{tmp / 'missing.gguf'}: not found"),
        "missing folder": (str(tmp / "no-such-folder"), f"{tmp / 'no-such-folder'}: not found"),
        "unknown name": ("llama-9000", "unknown model 'llama-9000'"),
        "unsupported architecture": (str(tmp / "gpt2.gguf"), "architecture 'gpt2' is not supported"),
        "unsupported tensor type": (str(tmp / "f64.gguf"), "blk.0.ffn_up.weight has type F64"),
        "truncated gguf": (str(tmp / "truncated.gguf"), "truncated.gguf"),
        "corrupt gguf": (str(tmp / "corrupt.gguf"), "corrupt.gguf: not a readable GGUF file"),
        "folder without config": (str(tmp / "empty-folder"), "no config.json"),
    }


def test_bad_input_is_one_error_line(tmp_path):
    for case, (arg, message) in bad_inputs(tmp_path).items():
        done = download(arg, cache=tmp_path / "cache")
        assert done.returncode == 1, case
        assert done.stdout == "", case
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, (case, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, (case, done.stderr)
    models = tmp_path / "cache" / "models" / f"v{CONVERTER_VERSION}"
    assert not models.exists() or list(models.iterdir()) == []  # no half-converted folder
