"""The `ringserve` command. Each subcommand imports its module only when run, flags included:
only the subcommand named on the command line gets its flags, so that `ringserve download` never
pays for the server, a frontend never loads GPU code, and `ringserve serve`'s launcher, which
lives as long as the server, holds none of the other commands' imports (httpx, numpy)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib.metadata import version


def _download_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a Hugging Face model id (ORG/NAME, ORG/NAME:QUANT), a .gguf file or a "
                        "known name (default: the default model)")
    p.add_argument("--revision", default=None, help="a model id's branch, tag or commit (default: main)")
    p.add_argument("--download-dir", default=None,
                   help="the Hugging Face cache to use (default: $HF_HUB_CACHE or $HF_HOME/hub)")


def _download(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    from ringserve.gpu.loader.model_store import download_command
    return download_command(args)


def _serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model (vLLM's `vllm serve MODEL`)")
    from ringserve.server.launch import add_serve_arguments  # argparse only; nothing heavy
    add_serve_arguments(p)


def _serve(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            p.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    from ringserve.server.launch import serve_command
    return serve_command(args)


def _loadgen_flags(p: argparse.ArgumentParser) -> None:
    from ringserve.tools.loadgen.cli import add_arguments  # argparse only
    add_arguments(p)


def _loadgen(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    from ringserve.tools.loadgen.cli import command
    return command(args)


def _trace_flags(p: argparse.ArgumentParser) -> None:
    from ringserve.server.trace_cli import add_arguments  # argparse + httpx
    add_arguments(p)


def _trace(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    from ringserve.server.trace_cli import command
    return command(args)


def _perplexity_flags(p: argparse.ArgumentParser) -> None:
    from ringserve.tools.perplexity import add_arguments  # numpy, gpu.settings
    add_arguments(p)


def _perplexity(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    from ringserve.tools.perplexity import command
    return command(args)


Flags = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace, argparse.ArgumentParser], int]
COMMANDS: dict[str, tuple[str, Flags, Run]] = {
    "download": ("fetch and convert a model; prints its folder last", _download_flags, _download),
    "serve": ("start the OpenAI-compatible HTTP server", _serve_flags, _serve),
    "loadgen": ("load-test a server: ring mode (its engines, no HTTP) or HTTP mode (any "
                "OpenAI-compatible server)", _loadgen_flags, _loadgen),
    "trace": ("send one traced request to a running server and print its journey, station by "
              "station", _trace_flags, _trace),
    "perplexity": ("perplexity of models over a text, llama-perplexity's way (int8 vs float32 "
                   "activations, weight types)", _perplexity_flags, _perplexity),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = argv[0] if argv else None  # NOTE: the top level has no flags but --help and --version
    # allow_abbrev=False everywhere: a prefix must never stand for another flag (--metrics is
    # not --metrics-prefix), and a flag added later must not change what an old command means.
    parser = argparse.ArgumentParser(prog="ringserve", allow_abbrev=False,
                                     description="ringserve: an OpenAI-compatible LLM server")
    parser.add_argument("--version", action="version", version=f"ringserve {version('ringserve')}")
    sub = parser.add_subparsers(dest="command", required=True)
    parsers = {}
    for name, (text, flags, _) in COMMANDS.items():
        parsers[name] = sub.add_parser(name, help=text, allow_abbrev=False)
        if name == named:
            flags(parsers[name])
    args = parser.parse_args(argv)
    return COMMANDS[args.command][2](args, parsers[args.command])


if __name__ == "__main__":
    sys.exit(main())
