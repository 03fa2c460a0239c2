"""Hugging Face model ids, as vLLM's ``--model`` and llama.cpp's ``-hf`` take them.

``ORG/NAME`` is a repository on the Hub: its safetensors checkpoint (config.json + *.safetensors)
when it has one, else one of its GGUF files, picked as llama.cpp picks: Q4_K_M, then Q8_0, then
the first. ``ORG/NAME:QUANT`` is that repository's GGUF of that quant (case-insensitive; the
quant followed by "." or "-" in the file name, llama.cpp's rule); none or several such files are
refused in one line that names the GGUF files there are.

The local Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub;
--download-dir in its place) is looked in first, with no network: a model there is served
offline. Else huggingface_hub downloads only what serving needs (the checkpoint's json and
safetensors files, or the one GGUF) into that cache, with its own progress bars, $HF_TOKEN for
gated and private repositories, and $HF_ENDPOINT for another hub. Imported only when a model
id is resolved: huggingface_hub is not loaded for a local model.
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ringserve.gpu.errors import ModelError

_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<quant>[\w.-]+))?")
PREFERRED_QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's -hf without a tag, in this order
# What serving a safetensors checkpoint reads (gpu/loader, server/tokenizer.py): nothing else
# of the repository (other formats' weights, README, images) is downloaded.
CHECKPOINT_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "*.safetensors",
                    "model.safetensors.index.json"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja"]
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)  # llama.cpp's split files


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    quant: str | None = None  # ORG/NAME:QUANT

    @classmethod
    def parse(cls, spec: str) -> HubModel | None:
        """The model id in ``spec``, or None when it is not shaped like one."""
        m = _HUB_ID.fullmatch(spec)
        return None if m is None else cls(m["repo"], m["quant"])

    def choose(self, files: list[str]) -> str | None:
        """Of the repository's ``files``: the GGUF to serve, or None for its safetensors checkpoint."""
        if self.quant is None and "config.json" in files and any(f.endswith(".safetensors") for f in files):
            return None
        ggufs = sorted(f for f in files if f.lower().endswith(".gguf")
                       and "mmproj" not in PurePosixPath(f).name.lower())  # a vision projector
        if not ggufs:
            raise ModelError(f"{self.repo_id}: the repository has neither a safetensors checkpoint "
                             f"(config.json + *.safetensors) nor a .gguf file")
        for quant in (self.quant,) if self.quant else PREFERRED_QUANTS:
            hits = [f for f in ggufs if _has_quant(f, quant)]
            if len(hits) > 1 and not all(_SPLIT.search(f) for f in hits):
                raise ModelError(f"{self.repo_id}:{quant} is ambiguous: {', '.join(hits)}; give "
                                 f"a local path to one of them")
            if hits:
                return _one_file(self.repo_id, hits[0])
        if self.quant:
            raise ModelError(f"{self.repo_id}: no GGUF of quant {self.quant}; its GGUF files: "
                             f"{', '.join(ggufs)}")
        return _one_file(self.repo_id, ggufs[0])


def _has_quant(path: str, quant: str) -> bool:
    name, tag = PurePosixPath(path).name.lower(), quant.lower()
    return f"{tag}." in name or f"{tag}-" in name


def _one_file(repo_id: str, path: str) -> str:
    if _SPLIT.search(path):
        raise ModelError(f"{repo_id}: {path} is one part of a split GGUF, which is not supported "
                         f"here: merge it with llama.cpp's llama-gguf-split --merge and give the file")
    return path


def fetch(model: HubModel, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """The snapshot folder of the model's checkpoint, or its .gguf file: from the local cache,
    else downloaded into it. ModelError names the repository and the reason."""
    cached = _from_cache(model, revision, cache_dir)
    return cached if cached is not None else _download(model, revision, cache_dir)


def _from_cache(model: HubModel, revision: str | None, cache_dir: str | None) -> Path | None:
    """What the cache already holds of the model at `revision` (a branch, tag or commit), or None.
    Files appear in a snapshot only once downloaded in full (huggingface_hub's blobs)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound
    try:
        cache = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return None
    want = revision or "main"
    for repo in cache.repos:
        if repo.repo_id != model.repo_id or repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            if want in rev.refs or rev.commit_hash == want:
                files = [f.file_path.relative_to(rev.snapshot_path).as_posix() for f in rev.files]
                try:
                    choice = model.choose(files)
                except ModelError:
                    return None  # what is asked for is not there (yet): ask the Hub
                if choice is not None:
                    return rev.snapshot_path / choice
                return rev.snapshot_path if _complete(rev.snapshot_path) else None
    return None


def _complete(folder: Path) -> bool:
    """Whether a cached checkpoint has its config, tokenizer and every weights file."""
    import json
    if not ((folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()):
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return bool(shards) and all((folder / s).is_file() for s in shards)
    return any(folder.glob("*.safetensors"))


def _download(model: HubModel, revision: str | None, cache_dir: str | None) -> Path:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    repo = model.repo_id
    with _hub_errors(repo, revision, cache_dir):
        choice = model.choose(HfApi().list_repo_files(repo, revision=revision))
        if choice is None:
            return Path(snapshot_download(repo, revision=revision, cache_dir=cache_dir,
                                          allow_patterns=CHECKPOINT_FILES))
        return Path(hf_hub_download(repo, choice, revision=revision, cache_dir=cache_dir))


def fetch_tokenizer(repo_id: str, cache_dir: str | None = None) -> Path:
    """The snapshot folder of a repository's tokenizer files (--tokenizer): from the cache, else
    downloaded (those files only)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    with contextlib.suppress(LocalEntryNotFoundError):
        folder = Path(snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=TOKENIZER_FILES,
                                        local_files_only=True))
        if (folder / "tokenizer.json").is_file():
            return folder
    with _hub_errors(repo_id, None, cache_dir):
        folder = Path(snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=TOKENIZER_FILES))
    if not (folder / "tokenizer.json").is_file():
        raise ModelError(f"{repo_id}: no tokenizer.json in the repository (the tokenizer format served here)")
    return folder


@contextlib.contextmanager
def _hub_errors(repo: str, revision: str | None, cache_dir: str | None) -> Iterator[None]:
    """huggingface_hub's failures as one ModelError line naming the repository and the reason."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import logging as hub_logging
    hub_logging.set_verbosity_error()  # its retry warnings: the error, if any, is our one line
    where = constants.ENDPOINT
    try:
        yield
    except GatedRepoError:  # before its base class
        raise ModelError(f"{repo}: a gated repository: accept its terms on {where}/{repo} and set "
                         f"HF_TOKEN to a token of that account") from None
    except RevisionNotFoundError:
        raise ModelError(f"{repo}: no revision {revision!r} on {where}") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{repo}: not a local path, and no such repository on {where} (a private one "
                         f"needs HF_TOKEN)") from None
    except (OfflineModeIsEnabled, LocalEntryNotFoundError):
        raise ModelError(f"{repo}: not in the Hugging Face cache ({cache_dir or constants.HF_HUB_CACHE}) "
                         f"and downloads are off (HF_HUB_OFFLINE)") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise ModelError(f"{repo}: {where} answered HTTP {status}") from None
    except ModelError:
        raise
    except Exception as e:  # the transport's connection errors (requests' or httpx's, by version)
        raise ModelError(f"{repo}: cannot reach {where} and it is not in the Hugging Face cache "
                         f"({type(e).__name__}: {e})") from None
