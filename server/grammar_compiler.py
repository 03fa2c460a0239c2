"""A worker's grammar compiler: constraints are bounded, compiled and probed
(server/grammar_check.py) in a few processes of the worker's own, never on its event loop.

Why processes: llguidance compiles recursively in native code, and a hostile grammar can
overflow the stack (SIGSEGV) or take seconds; on the loop either would cut or freeze every
stream of the worker. Here a compile is awaited (the loop serves the other streams meanwhile),
has a wall-clock budget (--grammar-compile-timeout: the process is killed), and a process that
dies is a 400 for its request alone; a fresh one replaces it. Requests wait for a process in a
bounded queue (--grammar-compile-queue; past it 503). Outcomes, refusals included, are kept by
content hash in an LRU (--grammar-cache-size): a repeated schema costs a dictionary look-up,
and a repeated hostile one never reaches a process again.

The processes come from a forkserver (a fork of a small single-threaded server, not of this
multi-threaded worker) and import only ringserve.server/ipc and llguidance. Each compiles on a
thread whose stack is half the engine's main-thread default (COMPILE_STACK_BYTES), so what
compiles here also compiles in the engine, which compiles every grammar again (it trusts no
ring record).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing
import signal
import threading
from collections import OrderedDict
from dataclasses import asdict
from typing import Any

import msgspec

from ringserve.ipc.structured import StructuredOutputsParams
from ringserve.server.config import StructuredOutputsConfig
from ringserve.server.errors import APIError, bad_request
from ringserve.server.grammar_check import Job, Outcome

log = logging.getLogger("ringserve.grammar")

COMPILE_STACK_BYTES = 4 << 20  # the engine compiles on its main thread: 8 MiB by default
_encode_job = msgspec.msgpack.Encoder().encode
_decode_outcome = msgspec.msgpack.Decoder(Outcome).decode


class CompilerDied(Exception):
    pass


class _Process:
    """One compiler process and the pipe to it (one job at a time)."""

    def __init__(self, proc: Any, conn: Any):
        self.proc, self.conn = proc, conn

    @classmethod
    def start(cls, tokenizer_json: str, vocab_size: int | None, eos: list[int],
              cfg: StructuredOutputsConfig) -> _Process:
        """Blocking (the fork, the tokenizer's ~0.2 s): called on a thread."""
        ctx = multiprocessing.get_context("forkserver")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_main, args=(theirs, tokenizer_json, vocab_size, eos, asdict(cfg)),
                           name="ringserve-grammar", daemon=True)
        proc.start()
        theirs.close()
        try:
            ours.recv_bytes()  # ready: the tokenizer is made
        except EOFError:
            proc.join(5)
            raise CompilerDied(f"the grammar compiler did not start ({_exit(proc)})") from None
        return cls(proc, ours)

    async def run(self, job: bytes) -> Outcome:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.to_thread(self.conn.send_bytes, job)  # up to --max-grammar-bytes
            await readable
            return _decode_outcome(self.conn.recv_bytes())
        except (EOFError, OSError):  # it died (a native crash, the OOM killer)
            await asyncio.to_thread(self.proc.join, 5)
            raise CompilerDied(_exit(self.proc)) from None
        finally:
            loop.remove_reader(fd)

    def kill(self) -> None:
        self.proc.kill()
        self.conn.close()
        self.proc.join(5)


def _exit(proc: Any) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class GrammarCompiler:
    def __init__(self, tokenizer_json: str, vocab_size: int | None, eos: list[int],
                 cfg: StructuredOutputsConfig):
        self._start_args = (tokenizer_json, vocab_size, eos, cfg)
        # The forkserver imports what a compiler process needs once (a process replacing a dead
        # one starts in ms), and not the worker's __main__ (multiprocessing's default preload).
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            ["ringserve.server.grammar_compiler"])
        self.cfg = cfg
        self._idle: list[_Process] = []
        self._slots = asyncio.Semaphore(cfg.grammar_compile_processes)
        self._waiting = 0
        self._cache: OrderedDict[bytes, Outcome] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future] = {}
        self.compiles = 0  # jobs sent to a process (the cache's misses), for tests and logs

    async def compile(self, spec: StructuredOutputsParams, param: str) -> str:
        """The llguidance grammar of `spec`, or a 400 naming `param` (503: the queue is full)."""
        job = _encode_job(Job(param, spec))
        key = hashlib.blake2b(job, digest_size=16).digest()
        outcome = await self._outcome(key, job, param)
        if outcome.error is not None:
            raise bad_request(outcome.error, param=param)
        assert outcome.grammar is not None
        return outcome.grammar

    async def _outcome(self, key: bytes, job: bytes, param: str) -> Outcome:
        while True:
            outcome = self._cache.get(key)
            if outcome is not None:
                self._cache.move_to_end(key)
                return outcome
            pending = self._pending.get(key)
            if pending is None:
                break
            # The same constraint is compiling for another request: share its outcome (None:
            # that request failed or went away before it came; try again).
            outcome = await asyncio.shield(pending)
            if outcome is not None:
                return outcome
        self._pending[key] = fut = asyncio.get_running_loop().create_future()
        outcome = None
        try:
            outcome = await self._run(job, param)
            self._remember(key, outcome)
            return outcome
        finally:
            del self._pending[key]
            fut.set_result(outcome)

    def _remember(self, key: bytes, outcome: Outcome) -> None:
        if self.cfg.grammar_cache_size == 0:
            return
        self._cache[key] = outcome
        while len(self._cache) > self.cfg.grammar_cache_size:
            self._cache.popitem(last=False)

    async def _run(self, job: bytes, param: str) -> Outcome:
        if self._slots.locked() and self._waiting >= self.cfg.grammar_compile_queue:
            raise APIError(503, f"{self._waiting} constraints are waiting to compile on this "
                           f"worker (--grammar-compile-queue); try again", param=param,
                           code="grammar_queue_full")
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            return await self._on_a_process(job, param)
        finally:
            self._slots.release()

    async def _on_a_process(self, job: bytes, param: str) -> Outcome:
        proc = self._idle.pop() if self._idle else None
        if proc is None:
            try:
                proc = await asyncio.to_thread(_Process.start, *self._start_args)
            except CompilerDied as e:
                log.error("%s", e)
                raise APIError(503, str(e), code="grammar_compiler_unavailable") from None
        self.compiles += 1
        timeout = self.cfg.grammar_compile_timeout
        try:
            outcome = await asyncio.wait_for(proc.run(job), timeout)
        except asyncio.TimeoutError:
            await asyncio.to_thread(proc.kill)
            log.warning("%s took over %s s to compile: its compiler process was killed", param,
                        timeout)
            return Outcome(error=f"{param} takes longer than {timeout:g} s to compile "
                                 f"(--grammar-compile-timeout)")
        except CompilerDied as e:
            await asyncio.to_thread(proc.kill)
            log.warning("compiling %s crashed its compiler process (%s); a new one replaces it",
                        param, e)
            return Outcome(error=f"{param} cannot be compiled: the grammar compiler failed on "
                                 f"it ({e})")
        except BaseException:  # cancelled (client gone): its answer would come to the next job
            await asyncio.shield(asyncio.to_thread(proc.kill))
            raise
        self._idle.append(proc)
        return outcome

    def close(self) -> None:
        for proc in self._idle:
            proc.kill()
        self._idle.clear()


# --- the compiler process --------------------------------------------------------------------

def _main(conn: Any, tokenizer_json: str, vocab_size: int | None, eos: list[int], cfg: dict) -> None:
    """A compiler process: make the tokenizer, then answer jobs until the worker goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when it ends
    threading.stack_size(COMPILE_STACK_BYTES)
    t = threading.Thread(target=_serve, args=(conn, tokenizer_json, vocab_size, eos, cfg),
                         name="compile")
    t.start()
    t.join()


def _serve(conn: Any, tokenizer_json: str, vocab_size: int | None, eos: list[int], cfg: dict) -> None:
    from llguidance import LLExecutor

    from ringserve.ipc.structured import make_ll_tokenizer
    from ringserve.server.grammar_check import check_and_compile

    config = StructuredOutputsConfig(**cfg)
    tokenizer = make_ll_tokenizer(tokenizer_json, vocab_size, eos)
    executor = LLExecutor()
    decode_job = msgspec.msgpack.Decoder(Job).decode
    encode = msgspec.msgpack.Encoder().encode
    conn.send_bytes(b"ready")
    while True:
        try:
            job = decode_job(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the worker is gone
        conn.send_bytes(encode(check_and_compile(job, tokenizer, executor, config)))
