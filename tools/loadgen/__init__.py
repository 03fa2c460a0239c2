"""`ringserve loadgen`: drive a server's engines straight through the shared-memory rings (ring
mode, no HTTP in the way) or any OpenAI-compatible server over HTTP + SSE, and report latency and
throughput the way vLLM's `bench serve` does.

    workload.py  what to send: random, shared-prefix or JSONL prompts (RequestSpec)
    backends.py  how to send one request: RingBackend (engine client), HttpBackend (httpx)
    discover.py  where a running `ringserve serve` keeps its engines' control sockets
    runner.py    when to send: fixed concurrency or Poisson arrivals, bounded by count and time
    stats.py     RequestResult -> Summary (throughput, TTFT/TPOT/ITL/E2E percentiles, goodput)
    report.py    text tables, --json, --compare
    plot.py      latency against throughput PNG (the optional `plot` extra: matplotlib)
    cli.py       the `loadgen` subcommand
"""
