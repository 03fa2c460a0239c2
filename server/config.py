"""The frontend's settings (ServerConfig, ParallelConfig) and the one way a settings dataclass
becomes command-line flags (add_arguments, from_args).

Every setting is a dataclass field that holds its default, its help text (metadata "help") and
its choices (metadata "choices"), and its class checks it in __post_init__. `ringserve serve`'s
flags are generated from these classes, engine/config.py's EngineConfig and its parts
(DeviceConfig, CacheConfig, SchedulerConfig) and RequestLimits (server/launch.py
add_serve_arguments): the flag of field `max_num_seqs` is `--max-num-seqs`. The server modules
take their defaults from here. This module imports nothing of ringserve but two constants of
ipc/ (and no numpy): a worker may import it, and the launcher, which lives as long as the
server, builds its settings with nothing else of the frontend imported.
"""
from __future__ import annotations

import argparse
import json
import os
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass

from ringserve.ipc.limits import MAX_LOGPROB_ENTRY_BYTES
from ringserve.ipc.ring import DEFAULT_MAX_MESSAGE

API_KEY_ENV = "RINGSERVE_API_KEY"  # --api-key's default
WORKER_CONFIG_ENV = "RINGSERVE_WORKER_CONFIG"  # the JSON a worker builds its app from (worker.py)
METRICS_PREFIXES = ("ringserve", "vllm")  # --metrics-prefix: every metric is "<prefix>:..."


@dataclass(kw_only=True)
class ParallelConfig:
    """How many processes serve."""
    engines: int | None = field(default=None, metadata={
        "aliases": ("--data-parallel-size", "-dp"),
        "help": "engine processes, each a whole model on one device (vLLM's data parallelism; "
                "default: one per visible GPU on cuda, 1 on cpu)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "aliases": ("-tp",),
        "help": "vLLM's flag, 1 only: an engine runs on one device here (scale out with "
                "--engines / --data-parallel-size, or servers behind a router: docs/scale-out.md)"})
    pipeline_parallel_size: int = field(default=1, metadata={
        "aliases": ("-pp",), "help": "vLLM's flag, 1 only, as --tensor-parallel-size"})
    # NOTE: half the cores this process may use: the engines need the rest (a CPU engine's
    # threads, a CUDA engine's loop), and each worker is a Python process with its own tokenizer
    workers: int = field(default_factory=lambda: max(1, len(os.sched_getaffinity(0)) // 2), metadata={
        "help": "Gunicorn workers: HTTP, tokenization and detokenization (default: half the "
                "cores, at least 1)"})

    def __post_init__(self) -> None:
        _at_least(self, 1, "engines", "workers")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) != 1:
                raise ValueError(f"{_flag(name)} {getattr(self, name)}: this build runs each engine on "
                                 f"one device, a whole model per GPU; scale out with --engines N "
                                 f"(vLLM's --data-parallel-size: one engine per GPU) or several servers "
                                 f"behind a router (docs/scale-out.md)")


@dataclass(kw_only=True)
class ServerConfig:
    """The HTTP server: where it listens, who may call it, its limits and timeouts."""
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    served_model_name: list[str] | None = field(default=None, metadata={
        "help": "name(s) the API answers to (default: the model folder's name)"})
    api_key: str | None = field(default_factory=lambda: os.environ.get(API_KEY_ENV), metadata={
        "help": f"require `Authorization: Bearer <key>` on the API routes (default: "
                f"${API_KEY_ENV}; none: no key)"})
    max_body_bytes: int = field(default=1 << 20, metadata={
        "help": "larger request bodies get 413"})
    timeout_keep_alive: int = field(default=5, metadata={
        "help": "close a connection idle this many seconds (none sent yet, or between requests)"})
    timeout_header_read: float = field(default=30.0, metadata={
        "help": "close (408) a connection whose request line and headers take longer, counted "
                "from their first byte"})
    # A deadline, not nginx's inactivity timer (client_body_timeout, 60 s between two reads),
    # which one byte a period defeats; --max-body-bytes in 30 s is ~35 KB/s.
    timeout_body_read: float = field(default=30.0, metadata={
        "help": "close (408) a connection whose request body has not all arrived this many "
                "seconds after its headers"})
    h11_max_incomplete_event_size: int = field(default=16384, metadata={
        "help": "largest request line + headers in bytes; a larger head gets 431 and the "
                "connection is closed"})
    max_stream_backlog: int = field(default=1024, metadata={
        "help": "engine outputs a stream may hold unsent (its client is not reading) before "
                "the request is aborted and its connection closed"})
    drain_timeout: float = field(default=30.0, metadata={
        "help": "seconds SIGTERM waits for open streams before stopping"})
    # >10x the longest default CPU step (docs/engine.md).
    engine_hang_timeout: float = field(default=120.0, metadata={
        "help": "an engine with no heartbeat, or one step running, for this many seconds is "
                "killed and restarted; its open requests fail"})
    log_level: str = field(default="info", metadata={
        "choices": ("critical", "error", "warning", "info", "debug"), "help": "log level"})
    uvicorn_log_level: str = field(default="info", metadata={
        "choices": ("critical", "error", "warning", "info", "debug", "trace"),
        "help": "the log level of Uvicorn's own loggers in the workers (vLLM's flag)"})
    disable_log_requests: bool = field(default=False, metadata={
        "help": "no access line per request (method, path, status, duration, request id), as "
                "vLLM's flag"})
    root_path: str | None = field(default=None, metadata={
        "help": "the path prefix a reverse proxy serves this server under (ASGI root_path, as "
                "vLLM's): requests arrive with it stripped, or not, and route the same"})
    ssl_keyfile: str | None = field(default=None, metadata={
        "help": "serve HTTPS with this private key (PEM), and --ssl-certfile"})
    ssl_certfile: str | None = field(default=None, metadata={
        "help": "serve HTTPS with this certificate chain (PEM), and --ssl-keyfile"})
    allowed_origins: list[str] | None = field(default=None, metadata={
        "help": "CORS: browser origins allowed to call the API (\"*\" for any; vLLM's JSON list "
                "form '[\"https://a.example\"]' is taken too): Access-Control-Allow-Origin on "
                "their responses and preflight OPTIONS answered without the API key (default: none, "
                "no CORS headers; vLLM's default is \"*\")"})
    allowed_methods: list[str] = field(default_factory=lambda: ["*"], metadata={
        "help": "CORS: the methods a preflight may ask for (vLLM's flag; a JSON list too); another "
                "is a 400 and the browser refuses it (default: \"*\", any the route serves)"})
    allowed_headers: list[str] = field(default_factory=lambda: ["*"], metadata={
        "help": "CORS: the request headers a preflight may ask for (vLLM's flag; a JSON list too; "
                "Accept, Accept-Language, Content-Language and Content-Type always); another is a 400 "
                "(default: \"*\", any)"})
    allow_credentials: bool = field(default=False, metadata={
        "help": "CORS: allow credentials (cookies, Authorization) from the allowed origins "
                "(vLLM's flag): Access-Control-Allow-Credentials, and the origin echoed, never \"*\""})
    metrics_prefix: str = field(default="ringserve", metadata={
        "choices": METRICS_PREFIXES,
        "help": "the prefix of every /metrics name: \"vllm\" serves vLLM's names (vllm:...), for "
                "dashboards and routers that read those"})
    enable_debug_endpoints: bool = field(default=False, metadata={
        "help": "serve GET /debug/engines and /dashboard (engines publish a snapshot)"})
    tool_call_parser: str | None = field(default=None, metadata={
        "choices": ("hermes", "llama3_json", "phi4_mini_json", "pythonic"),
        "help": "how the model writes tool calls (Hermes/Qwen <tool_call> JSON, Llama 3 JSON, "
                "Phi-4-mini's functools[...], or a Python list of calls: Gemma 3, Llama 3.2), "
                "for tool_choice \"auto\" with --enable-auto-tool-choice"})
    enable_auto_tool_choice: bool = field(default=False, metadata={
        "help": "serve tool_choice \"auto\" (the default when a request has tools): the model "
                "writes text and --tool-call-parser turns its calls into tool_calls, as vLLM's "
                "flag; without it \"auto\" is a 400 (\"required\", named and \"none\" work)"})
    generation_config: str = field(default="auto", metadata={
        "help": "default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty) "
                "for requests that leave them out, as vLLM's flag: auto takes the model's "
                "generation_config.json, vllm none (SamplingParams' own), a folder its "
                "generation_config.json"})
    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template, a file or the template itself (vLLM's rule: text with "
                "none of \"{\", \"}\" or a newline is a file name), in place of the model's"})
    reasoning_parser: str | None = field(default=None, metadata={
        "choices": ("qwen3", "deepseek_r1"),
        "help": "move the model's <think>...</think> into message.reasoning_content (streamed "
                "as delta.reasoning_content), as vLLM's flag (default: none, all is content)"})

    def __post_init__(self) -> None:
        _at_least(self, 1, "max_body_bytes", "timeout_keep_alive", "h11_max_incomplete_event_size",
                  "max_stream_backlog")
        for name in ("timeout_header_read", "timeout_body_read", "engine_hang_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{_flag(name)} must be positive, got {getattr(self, name)}")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be at least 0, got {self.drain_timeout}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        self._check_frontend_flags()

    def _check_frontend_flags(self) -> None:
        """vLLM's frontend flags: tools, TLS, CORS, the root path, the chat template (read here:
        after this, chat_template holds the template's text)."""
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        for name in ("ssl_keyfile", "ssl_certfile"):
            if getattr(self, name) is not None and not os.path.isfile(getattr(self, name)):
                raise ValueError(f"{_flag(name)} {getattr(self, name)}: file not found")
        self._check_cors()
        if self.root_path is not None and not (self.root_path.startswith("/") and self.root_path != "/"):
            raise ValueError(f"--root-path must start with \"/\", got {self.root_path!r}")
        if self.root_path is not None:
            self.root_path = self.root_path.rstrip("/")
        if self.chat_template is not None:
            self.chat_template = _chat_template_text(self.chat_template)

    def _check_cors(self) -> None:
        if self.allowed_origins is not None:
            self.allowed_origins = _json_list("allowed_origins", self.allowed_origins)
        self.allowed_methods = [m.upper() for m in _json_list("allowed_methods", self.allowed_methods)]
        self.allowed_headers = _json_list("allowed_headers", self.allowed_headers)
        if not self.allowed_origins:  # vLLM's default origin is "*"; here CORS is off without one
            for name in ("allowed_methods", "allowed_headers", "allow_credentials"):
                if getattr(self, name) not in (["*"], False):
                    raise ValueError(f"{_flag(name)} needs --allowed-origins: without it there is no CORS")


@dataclass(kw_only=True)
class StructuredOutputsConfig:
    """Bounds on what a request's constraint (schema, regex, choices, grammar, tool schemas) and
    its JSON given as text may be, checked before llguidance sees any of it, and the worker's
    grammar compiler: its processes, queue, time budget and cache (server/grammar_compiler.py).
    A constraint over a bound is a 400 naming the field and the flag."""
    max_grammar_bytes: int = field(default=1 << 18, metadata={
        "help": "most UTF-8 bytes of one constraint: a JSON schema (as JSON text), regex, "
                "grammar or tool schemas"})
    max_grammar_rules: int = field(default=1000, metadata={
        "help": "most rules (and terminals) in a Lark or GBNF grammar"})
    max_grammar_depth: int = field(default=128, metadata={
        "help": "deepest chain of grammar rules referring to one another, or of JSON-schema "
                "levels and $refs followed in a row (grammar compilers recurse along it)"})
    max_grammar_items: int = field(default=2000, metadata={
        "help": "most alternatives (grammar |, JSON-schema anyOf/oneOf/enum/choice entries) and "
                "properties in one constraint"})
    max_choices: int = field(default=1000, metadata={
        "help": "most strings in a choice list (guided_choice, structured_outputs.choice)"})
    max_choice_bytes: int = field(default=1 << 16, metadata={
        "help": "most UTF-8 bytes of a choice list's strings together"})
    max_json_depth: int = field(default=64, metadata={
        "help": "deepest nesting of JSON given as text (a schema string, tool-call arguments "
                "in history) and of a JSON schema"})
    grammar_compile_timeout: float = field(default=10.0, metadata={
        "help": "seconds a constraint may take to compile; then its compiler process is killed "
                "and the request gets 400"})
    grammar_compile_processes: int = field(default=1, metadata={
        "help": "processes per worker that compile constraints (off the event loop; a crash "
                "there is a 400, not a dead worker)"})
    grammar_compile_queue: int = field(default=1024, metadata={
        "help": "constraints a worker may hold waiting for a compiler process; more get 503"})
    grammar_cache_size: int = field(default=256, metadata={
        "help": "compiled constraints (and refusals) a worker remembers by content, so a "
                "repeated one costs nothing"})

    def __post_init__(self) -> None:
        # Upper bounds: past them a limit no longer protects anything (the body limit, the
        # decoder's recursion, the machine's processes).
        for name, low, high in (("max_grammar_bytes", 1, 1 << 26), ("max_grammar_rules", 1, 1 << 20),
                                ("max_grammar_depth", 1, 1000), ("max_grammar_items", 1, 1 << 20),
                                ("max_choices", 1, 1 << 20), ("max_choice_bytes", 1, 1 << 26),
                                ("max_json_depth", 1, 500), ("grammar_compile_processes", 1, 64),
                                ("grammar_compile_queue", 0, 1 << 16),
                                ("grammar_cache_size", 0, 1 << 20)):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{_flag(name)} must be in [{low}, {high}], got {value}")
        if not 0 < self.grammar_compile_timeout <= 3600:
            raise ValueError(f"--grammar-compile-timeout must be in (0, 3600] seconds, got "
                             f"{self.grammar_compile_timeout}")


def _limit(default: int, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for: each field is the `ringserve serve` flag of its name
    (server/config.py add_arguments), with a default no real client reaches. Each bounds work
    or memory that a small body could otherwise multiply."""
    max_logprobs: int = _limit(20, "most logprobs / top_logprobs a request may ask for "
                                   "(vLLM's flag and default)")
    max_choices_per_request: int = _limit(1024, "most engine requests one request may start: "
                                                "prompts x n")
    max_stop_strings: int = _limit(64, "most stop strings per request (each is searched at "
                                       "every token)")
    max_stop_bytes: int = _limit(4096, "most UTF-8 bytes of a request's stop strings together")
    max_stop_token_ids: int = _limit(1024, "most stop_token_ids per request")
    # n=3 x 8k tokens x 21 fits. Each entry is ~25 B of JSON and ~120 B of worker memory at
    # the answer's peak, which the worker keeps as its high-water mark: 2^21 entries made a
    # 51.5 MB answer and left a worker at 542 MB (from 182); at 2^19 it is ~13 MB and ~+90 MB.
    max_response_logprobs: int = _limit(1 << 19, "most logprob entries one answer may hold: "
                                                 "choices x tokens (echoed prompt included) x "
                                                 "(1 + logprobs)")

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < (0 if name == "max_logprobs" else 1):
                raise ValueError(f"--{name.replace('_', '-')} must be at least "
                                 f"{0 if name == 'max_logprobs' else 1}, got {value}")
        # An answer's logprobs (an echoed prompt's come in one engine output) must fit one
        # ring message, so that no output is ever too large to send (docs/ipc.md).
        most = DEFAULT_MAX_MESSAGE // MAX_LOGPROB_ENTRY_BYTES
        if self.max_response_logprobs > most:
            raise ValueError(f"--max-response-logprobs must be at most {most} (one engine "
                             f"message of {DEFAULT_MAX_MESSAGE} bytes), got {self.max_response_logprobs}")


def _chat_template_text(value: str) -> str:
    """--chat-template's text: the file it names, or itself when it holds "{", "}" or a newline
    (vLLM's rule, so that a mistyped path is an error rather than a template saying the path)."""
    if any(c in value for c in "{}\n"):
        return value
    try:
        with open(os.path.expanduser(value), encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--chat-template {value}: {e.strerror or e} (give a file, or the template "
                         f"itself)") from None
    except UnicodeDecodeError:
        raise ValueError(f"--chat-template {value}: not UTF-8 text") from None


def _json_list(name: str, values: list[str]) -> list[str]:
    """A CORS flag's values: given one by one, or as one JSON list (vLLM's form)."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            parsed = json.loads(values[0])
        except json.JSONDecodeError as e:
            raise ValueError(f"{_flag(name)}: not a JSON list: {e}") from None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"{_flag(name)}: the JSON form is a list of strings")
        return parsed
    return values


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _at_least(obj, low: int, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < low:
            raise ValueError(f"{_flag(name)} must be at least {low}, got {value}")


# -- flags from fields ---------------------------------------------------------------------

def setting_fields(cls: type) -> list[Field]:
    """The fields of `cls` that are settings, a flag each: those with help. A part of a composed
    config (EngineConfig.cache_config: a settings class of its own, whose fields are the flags)
    has none."""
    return [f for f in fields(cls) if "help" in f.metadata]


def field_default(f: Field):
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def add_arguments(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One flag per setting field of `cls` (setting_fields), in a group named `title`:
    the name from the field's, type, default, choices and help from the field. A bool is
    `--x/--no-x` (vLLM's way); a `list[...]` takes one or more values. A plain default is shown in --help;
    one made by a factory (the core count, an environment variable) is described by the help."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in setting_fields(cls):
        kind = hints[f.name]
        args = typing.get_args(kind)
        if type(None) in args:  # X | None
            kind = next(a for a in args if a is not type(None))
        help_text = f.metadata["help"]
        kwargs: dict = {"default": field_default(f), "dest": f.name}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            if typing.get_origin(kind) is list:
                kind, kwargs["nargs"] = typing.get_args(kind)[0], "+"
            kwargs["type"] = kind
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
        if f.default is not MISSING and f.default is not None:
            help_text += " (default: %(default)s)"
        group.add_argument(_flag(f.name), *f.metadata.get("aliases", ()), help=help_text, **kwargs)


def from_args(cls: type, args: argparse.Namespace, **overrides):
    """`cls` built from the parsed flags of its setting fields, and each of its parts (a field
    whose type is a settings dataclass) from the flags of its own."""
    hints = typing.get_type_hints(cls)
    values = {f.name: from_args(hints[f.name], args) if is_dataclass(hints[f.name]) else getattr(args, f.name)
              for f in fields(cls)}
    return cls(**{**values, **overrides})
