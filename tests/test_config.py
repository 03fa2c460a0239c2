"""One config: `ringserve serve`'s flags are the settings dataclasses' fields, exactly (each with
its default, help and choices), the engine and its runners take those defaults, each setting is
checked once, and the CLI's --help loads neither engine nor GPU code."""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
from dataclasses import MISSING

import pytest

from conftest import free_port
from ringserve.engine.config import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    CUDA_MAX_NUM_BATCHED_TOKENS,
    EngineConfig,
    SchedulerConfig,
)
from ringserve.gpu.settings import DTYPES, CacheConfig, DeviceConfig, StepLimits
from ringserve.server.config import (
    ParallelConfig,
    RequestLimits,
    ServerConfig,
    StructuredOutputsConfig,
    setting_fields,
)

# Every settings class of `serve`, written out here (not taken from the launcher): a class the
# launcher forgot, or a flag it adds by hand, makes the comparison below fail.
SETTINGS = (EngineConfig, DeviceConfig, CacheConfig, SchedulerConfig, ParallelConfig, ServerConfig,
            RequestLimits, StructuredOutputsConfig)


def _serve_parser() -> argparse.ArgumentParser:
    from ringserve.server.launch import add_serve_arguments
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p


def _expected_default(f):
    return f.default_factory() if f.default is MISSING else f.default


def test_serve_flags_are_exactly_the_config_fields():
    settings = {f.name: f for cls in SETTINGS for f in setting_fields(cls)}
    actions = {a.dest: a for a in _serve_parser()._actions if a.dest != "help"}
    assert sorted(actions) == sorted(settings)  # every field a flag, no flag without a field
    for name, f in settings.items():
        a = actions[name]
        flag = "--" + name.replace("_", "-")
        assert a.option_strings[0] == flag, name
        assert a.default == _expected_default(f), name
        assert f.metadata["help"].strip() and a.help.startswith(f.metadata["help"]), name
        assert a.choices == f.metadata.get("choices"), name
        if isinstance(f.default, bool):
            assert a.option_strings == [flag, "--no-" + flag[2:]], name


def test_serve_flags_parse_to_the_config_types():
    a = _serve_parser().parse_args(
        ["--max-num-seqs", "7", "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching",
         "--served-model-name", "a", "b", "--kv-cache-memory-bytes", "4096", "--max-logprobs", "3"])
    assert (a.max_num_seqs, a.gpu_memory_utilization, a.enable_prefix_caching) == (7, 0.5, False)
    assert (a.served_model_name, a.kv_cache_memory_bytes, a.max_logprobs) == (["a", "b"], 4096, 3)
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["--dtype", "int8"])


def test_api_key_flag_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("RINGSERVE_API_KEY", "sk-from-env")
    assert _serve_parser().parse_args([]).api_key == "sk-from-env"
    monkeypatch.delenv("RINGSERVE_API_KEY")
    assert _serve_parser().parse_args([]).api_key is None


def test_serve_help_explains_every_flag_without_loading_gpu_code():
    """`ringserve serve --help` in a fresh interpreter: every flag is there, and building the
    parser imported no numba, CuPy or engine core (gpu/settings.py and engine/config.py only)."""
    code = ("import sys\nfrom ringserve.tools.cli import main\n"
            "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('numba', 'cupy', 'ringserve.engine.core', 'ringserve.gpu.runner')"
            " if m in sys.modules]\nprint('HEAVY', heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=os.environ).stdout
    assert "HEAVY []" in out, out
    for cls in SETTINGS:
        for f in setting_fields(cls):
            assert "--" + f.name.replace("_", "-") + " " in out, f.name


def test_max_num_batched_tokens_default_is_resolved_by_device():
    def budget(**settings) -> int | None:
        return EngineConfig.create(**settings).scheduler_config.max_num_batched_tokens
    assert budget(device="cpu") == CPU_MAX_NUM_BATCHED_TOKENS == 512
    # "cuda" is taken as given (no GPU needed to build the config)
    assert budget(device="cuda") == CUDA_MAX_NUM_BATCHED_TOKENS == 8192
    assert budget(device="cpu", max_num_batched_tokens=64) == 64


@pytest.mark.parametrize("kwargs, match", [
    ({"max_num_seqs": 0}, "max_num_seqs must be at least 1"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be at least 1"),
    ({"block_size": 0}, "block_size must be at least 1"),
    ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"dtype": "int8"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"attention_backend": "flash"}, "attention_backend"),
])
def test_engine_config_refuses_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.create(**{"device": "cpu", **kwargs})


@pytest.mark.parametrize("cls, kwargs, match", [
    (ServerConfig, {"timeout_keep_alive": 0}, "--timeout-keep-alive must be at least 1"),
    (ServerConfig, {"max_stream_backlog": 0}, "--max-stream-backlog"),
    (ServerConfig, {"h11_max_incomplete_event_size": 0}, "--h11-max-incomplete-event-size"),
    (ServerConfig, {"timeout_header_read": 0}, "--timeout-header-read must be positive"),
    (ServerConfig, {"engine_hang_timeout": -1}, "--engine-hang-timeout must be positive"),
    (ParallelConfig, {"workers": 0}, "--workers must be at least 1"),
    (ParallelConfig, {"engines": 0}, "--engines must be at least 1"),
    # an answer's logprobs must fit one ring message (docs/ipc.md): 64 MiB / 23 bytes an entry
    (RequestLimits, {"max_response_logprobs": 2_917_777}, "--max-response-logprobs must be at most 2917776"),
])
def test_server_configs_refuse_bad_settings(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_llm_takes_the_engine_config_names(tiny_model_dir):
    from ringserve.server.llm import LLM
    llm = LLM(str(tiny_model_dir), device="cpu", max_num_seqs=3, num_gpu_blocks_override=32,
              enable_prefix_caching=False)
    sched = llm.config.scheduler_config
    assert (sched.max_num_seqs, llm.engine.scheduler.max_num_seqs) == (3, 3)
    assert (llm.engine.kv.num_blocks, sched.max_num_batched_tokens) == (32, 512)
    with pytest.raises(TypeError):
        LLM(str(tiny_model_dir), max_num_sequences=3)  # not a setting


def test_the_runners_take_the_configs_whole():
    """The runners take the settings objects, not their fields spread into keywords (no copy
    of a default to drift); EngineConfig's parts are those objects, its step limits the
    scheduler's."""
    from ringserve.gpu.runner import ModelRunner
    from ringserve.gpu.settings import CPU_DTYPES, CUDA_DTYPES
    params = inspect.signature(ModelRunner).parameters
    assert [(p.name, p.annotation) for p in list(params.values())[1:4]] == [
        ("device", "DeviceConfig | None"), ("cache", "CacheConfig | None"), ("limits", "StepLimits | None")]
    assert list(params) == ["model_dir", "device", "cache", "limits", "widen_packed", "mirror",
                            "defer_kv_cache"]  # no setting spread (mirror, defer: a draft and its target)
    c = EngineConfig.create(device="cpu", max_num_seqs=7, block_size=8, max_model_len=64)
    assert (type(c.device_config), type(c.cache_config), type(c.scheduler_config)) == (
        DeviceConfig, CacheConfig, SchedulerConfig)
    limits = StepLimits(max_num_seqs=7, max_num_batched_tokens=512, max_model_len=64)
    assert (c.cache_config.block_size, c.step_limits) == (8, limits)
    assert set(CPU_DTYPES) | set(CUDA_DTYPES) == set(DTYPES)


def test_step_limits_bound_one_requests_chunk_as_the_scheduler_does():
    """max_chunk_tokens (what the CPU runner's warm-up decides the tiled prefill attention by):
    the step's budget, the long-prefill cap and the context, whichever is least."""
    def chunk(**kwargs) -> int:
        return EngineConfig.create(device="cpu", **kwargs).step_limits.max_chunk_tokens
    assert chunk(max_num_batched_tokens=512, max_model_len=2048) == 512
    assert chunk(max_num_batched_tokens=512, max_model_len=2048, long_prefill_token_threshold=100) == 100
    assert chunk(max_num_batched_tokens=512, max_model_len=2048, long_prefill_token_threshold=4096) == 512
    assert chunk(max_num_batched_tokens=512, max_model_len=64, long_prefill_token_threshold=100) == 64
    assert StepLimits(max_num_seqs=1, max_num_batched_tokens=300).max_chunk_tokens == 300
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be at least 0"):
        StepLimits(max_num_seqs=1, max_num_batched_tokens=8, long_prefill_token_threshold=-1)


def test_the_flag_table_in_docs_lists_every_flag():
    from pathlib import Path
    rows = [line for line in (Path(__file__).parent.parent / "docs" / "serving.md").read_text()
            .splitlines() if line.startswith("| `--")]
    flags = {"--" + f.name.replace("_", "-") for cls in SETTINGS for f in setting_fields(cls)}
    listed = {flag for line in rows for flag in flags if f"`{flag}`" in line.split(" | ")[0]}
    assert listed == flags, sorted(flags - listed)


@pytest.mark.parametrize("flag, value, message", [
    ("--max-num-seqs", "0", "max_num_seqs must be at least 1"),          # EngineConfig
    ("--max-model-len", "0", "max_model_len must be at least 1"),
    ("--gpu-memory-utilization", "2", "gpu_memory_utilization must be in (0, 1]"),
    ("--workers", "0", "--workers must be at least 1"),                   # ParallelConfig
    ("--engine-hang-timeout", "0", "--engine-hang-timeout must be positive"),  # ServerConfig
    ("--max-json-depth", "-3", "--max-json-depth must be in [1, 500], got -3"),  # StructuredOutputsConfig
    ("--grammar-compile-processes", "100000", "--grammar-compile-processes must be in [1, 64]"),
])
def test_serve_refuses_a_bad_setting_before_starting(tiny_model_dir, flag, value, message):
    r = subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "serve", "--model",
                        str(tiny_model_dir), "--device", "cpu", "--port", str(free_port()), flag, value],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and message in r.stderr, r.stderr


@pytest.mark.parametrize("flag, value", [("--kv-cache-memory-bytes", str(1 << 50)),
                                         ("--num-gpu-blocks-override", str(1 << 31))])
def test_serve_refuses_a_kv_pool_the_machine_cannot_hold_in_one_line(tiny_model_dir, flag, value):
    """The pool is allocated lazily (np.zeros): without the check the server would start and
    fail mid-serving. The engine says what it needs and what there is, without a traceback."""
    r = subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "serve", "--model",
                        str(tiny_model_dir), "--device", "cpu", "--port", str(free_port()), flag, value],
                       capture_output=True, text=True, timeout=120)
    lines = [x for x in r.stderr.splitlines() if x.startswith("error: the model does not fit")]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert re.search(r"KV cache [\d.]+ GiB \(\d+ blocks\), [\d.]+ GiB in all, but [\d.]+ GiB are available",
                     lines[0]), lines[0]
    assert "Traceback" not in r.stderr
