"""`ringserve trace "prompt"`: send one traced request to a running server and print its
journey (docs/design.md §1) as a timeline, station by station, in milliseconds after arrival."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx

STATIONS = ("Frontend", "Engine client", "Engine core", "KV-cache manager", "Model runner",
            "Way back")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt (with --chat: the user message)")
    p.add_argument("--base-url", "--url", dest="url", default="http://127.0.0.1:8000",
                   help="the server's base URL (--url: the same, as loadgen takes it too)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("RINGSERVE_API_KEY"))
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument("--json", action="store_true", help="print the raw journey as JSON instead")


def request_trace(url: str, prompt: str, *, max_tokens: int, model: str | None = None,
                  api_key: str | None = None, chat: bool = False) -> tuple[str, dict[str, Any]]:
    """(generated text, journey) of one greedy traced request."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "ringserve_trace": True}
    if model:
        body["model"] = model
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(url.rstrip("/") + path, json=body, headers=headers, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:500]}")
    data = r.json()
    choice = data["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return text, data["ringserve_trace"]


def _ms(v: float | None) -> str:
    return "      ?   " if v is None else f"{v:9.3f}"


def _ranges(values: list[int]) -> str:
    """[48, 49, 50, 112] -> '48–50, 112'."""
    if not values:
        return "-"
    parts: list[str] = []
    start: int | None = values[0]
    for prev, cur in zip(values, values[1:] + [None], strict=True):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}–{prev}")
            start = cur
    return ", ".join(parts)


def _batch(b: dict) -> str:
    return (f"{b['num_tokens']} tokens in the super-sequence ({b['num_prefill_tokens']} prefill + "
            f"{b['num_decode_tokens']} decode) from {b['num_reqs']} requests; budgets "
            f"{b['max_num_batched_tokens']} tokens, {b['max_num_seqs']} sequences")


def format_journey(j: dict[str, Any], text: str | None = None) -> str:
    lines: list[str] = []

    def station(name: str) -> None:
        lines.append("")
        lines.append(f"── {name} " + "─" * max(0, 60 - len(name)))

    def at(t: float | None, what: str) -> None:
        lines.append(f"  {_ms(t)} ms  {what}")

    fe = j["frontend"]
    lines.append(f"journey of {j['request_id']} (times in ms after arrival)")
    station(STATIONS[0])
    at(0.0, f"arrived at worker {fe['pid']}")
    ids = fe["prompt_token_ids"]
    shown = ids if len(ids) <= 24 else ids[:20] + ["…"] + ids[-3:]
    at(fe["tokenize_ms"], f"validated and tokenized: {fe['num_prompt_tokens']} ids {shown}")
    for c in j["choices"]:
        if len(j["choices"]) > 1:
            lines.append("")
            lines.append(f"═══ choice {c['index']} ═══")
        ec = c["engine_client"]
        station(STATIONS[1])
        scores = ec["scores"] or []
        listed = ", ".join(f"engine {i}: {s}" for i, s in enumerate(scores))
        at(ec["chosen_ms"], f"scores 4·waiting+running: {listed or '?'} → engine {ec['engine']}")
        at(ec["written_ms"], "request written to its ring, engine doorbell rung")
        e = c["engine"]
        if e is None:
            station(STATIONS[2])
            lines.append("  (no engine journey: a stop string ended this choice in the worker)")
        else:
            _engine_part(e, station, at, lines)
        station(STATIONS[5])
        at(c["first_token_ms"], f"first token reached the worker (TTFT {c['ttft_ms']} ms)")
        at(c["last_token_ms"], f"last token; {c['num_output_tokens']} tokens in all")
        at(c["e2e_ms"], f"finished: {c['finish_reason']} (E2E {c['e2e_ms']} ms)")
    if text is not None:
        lines.append("")
        lines.append(f"text: {text!r}")
    return "\n".join(lines)


def _engine_part(e: dict, station, at, lines: list[str]) -> None:
    fin = e.get("finish") or {}
    bs = fin.get("block_size")
    station(STATIONS[2])
    at(e["received_ms"], "taken from the ring into `waiting`")
    for a in e["admissions"]:
        cached = a["num_cached_tokens"]
        hit = f", {cached} prompt tokens from the prefix cache" if cached else ""
        at(a["at_ms"], f"admitted by step {a['step']}{hit}: {_batch(a['batch'])}")
    for p in e["preemptions"]:
        at(p["at_ms"], f"PREEMPTED in step {p['step']}: blocks {p['blocks_freed']} freed, back to waiting")
    station(STATIONS[3])
    for a in e["allocations"]:
        at(a["at_ms"], f"step {a['step']}: got blocks {a['blocks']} → block table {a['block_table']}")
    if fin:
        at(fin["at_ms"], f"step {fin['step']}: blocks {fin['blocks_freed']} back to the pool; "
                         f"{fin['num_free_blocks_after']} of {fin['num_blocks']} free after the step")
    station(STATIONS[4])
    for s in e["steps"]:
        first, n = s["first_position"], s["num_new_tokens"]
        pos = f"position {first}" if n == 1 else f"positions {first}–{first + n - 1}"
        dur = (s["end_ms"] - s["start_ms"]) if s["end_ms"] is not None else None
        at(s["start_ms"], f"step {s['step']} {s['phase']}: {pos} → slots {_ranges(s['slots'])}; "
                          f"batch of {s['batch']['num_tokens']} tokens / {s['batch']['num_reqs']} reqs"
                          + (f"; {dur:.3f} ms" if dur is not None else ""))
    if fin and bs:
        lines.append(f"  slot = block_table[pos // {bs}] · {bs} + pos % {bs}; "
                     f"{fin['num_tokens_in_cache']} tokens in the cache at the end "
                     f"= {len(fin['blocks_freed'])} blocks")


def command(args: argparse.Namespace) -> int:
    try:
        text, journey = request_trace(args.url, args.prompt, max_tokens=args.max_tokens,
                                      model=args.model, api_key=args.api_key, chat=args.chat)
    except (httpx.HTTPError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out = json.dumps(journey, indent=2) if args.json else format_journey(journey, text)
    try:
        print(out, flush=True)
    except BrokenPipeError:  # `ringserve trace --json ... | head`: the reader has had enough
        # stdout's buffer is dropped rather than flushed again at exit (which would raise again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
