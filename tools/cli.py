"""The `ringserve` command. Each subcommand imports its module only when run, so that
`ringserve download` never pays for the server and a frontend never loads GPU code."""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import version


def main(argv: list[str] | None = None) -> int:
    # allow_abbrev=False everywhere: a prefix must never stand for another flag (--metrics is
    # not --metrics-prefix), and a flag added later must not change what an old command means.
    parser = argparse.ArgumentParser(prog="ringserve", description=__doc__, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"ringserve {version('ringserve')}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("download", help="fetch and convert a model; prints its folder last",
                       allow_abbrev=False)
    p.add_argument("model", nargs="?", default=None,
                   help="a Hugging Face model id (ORG/NAME, ORG/NAME:QUANT), a .gguf file or a "
                        "known name (default: the default model)")
    p.add_argument("--revision", default=None, help="a model id's branch, tag or commit (default: main)")
    p.add_argument("--download-dir", default=None,
                   help="the Hugging Face cache to use (default: $HF_HUB_CACHE or $HF_HOME/hub)")

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server", allow_abbrev=False)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as --model (vLLM's `vllm serve MODEL`)")
    from ringserve.server.launch import add_serve_arguments  # argparse only; nothing heavy
    add_serve_arguments(serve)

    p = sub.add_parser("loadgen", help="load-test a server: ring mode (its engines, no HTTP) or "
                                       "HTTP mode (any OpenAI-compatible server)", allow_abbrev=False)
    from ringserve.tools.loadgen.cli import add_arguments as add_loadgen_arguments  # argparse only
    add_loadgen_arguments(p)

    p = sub.add_parser("trace", help="send one traced request to a running server and print "
                                     "its journey, station by station", allow_abbrev=False)
    from ringserve.server.trace_cli import add_arguments as add_trace_arguments  # argparse + httpx
    add_trace_arguments(p)

    p = sub.add_parser("perplexity", help="perplexity of models over a text, llama-perplexity's way "
                                          "(int8 vs float32 activations, weight types)")
    from ringserve.tools.perplexity import add_arguments as add_perplexity_arguments  # gpu.settings
    add_perplexity_arguments(p)

    args = parser.parse_args(argv)
    if args.command == "download":
        from ringserve.gpu.loader.model_store import download_command
        return download_command(args)
    if args.command == "serve":
        if args.model_tag is not None:
            if args.model is not None and args.model != args.model_tag:
                serve.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
            args.model = args.model_tag
        from ringserve.server.launch import serve_command
        return serve_command(args)
    if args.command == "loadgen":
        from ringserve.tools.loadgen.cli import command as loadgen_command
        return loadgen_command(args)
    if args.command == "trace":
        from ringserve.server.trace_cli import command as trace_command
        return trace_command(args)
    if args.command == "perplexity":
        from ringserve.tools.perplexity import command as perplexity_command
        return perplexity_command(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
