"""server/worker.py preload: Gunicorn's master makes the workers' tokenizer once, before the fork,
so the workers share its pages (a 128K-entry tokenizer is ~45 MB a process); a folder it cannot
read is left to each worker, which reports it as it always has."""
from __future__ import annotations

import json

import pytest

from ringserve.server.config import WORKER_CONFIG_ENV
from ringserve.server.worker import _tokenizer_of, load_tokenizer, preload


def test_the_master_makes_the_tokenizer_the_workers_then_use(default_model_dir, tmp_path, monkeypatch):
    cfg = {"model_dir": str(default_model_dir)}
    monkeypatch.setenv(WORKER_CONFIG_ENV, json.dumps(cfg))
    load_tokenizer.cache_clear()
    preload()
    assert load_tokenizer.cache_info().misses == 1
    tokenizer = _tokenizer_of(cfg)  # what worker_app asks for, after the fork
    assert load_tokenizer.cache_info().misses == 1 and load_tokenizer.cache_info().hits == 1
    assert tokenizer.encode("Hello") and tokenizer.vocab_size > 1000

    bad = {"model_dir": str(tmp_path)}  # no tokenizer.json: the master says nothing
    monkeypatch.setenv(WORKER_CONFIG_ENV, json.dumps(bad))
    preload()
    with pytest.raises(Exception, match="tokenizer.json|No such file"):
        _tokenizer_of(bad)
    load_tokenizer.cache_clear()
