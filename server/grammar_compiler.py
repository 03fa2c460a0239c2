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

Each process is a fresh interpreter (`python -m ringserve.server.grammar_compiler`: no fork of
this multi-threaded worker, none of its modules but ringserve.server/ipc and llguidance) that
talks over its stdin and stdout, runs at nice 19 (a long compile yields the cores to the engine
and the workers), and compiles on a thread whose stack is half the engine's main-thread default
(COMPILE_STACK_BYTES), so what compiles here also compiles in the engine, which compiles every
grammar again (it trusts no ring record).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import sys
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
_encode = msgspec.json.Encoder().encode
_decode_outcome = msgspec.json.Decoder(Outcome).decode


class CompilerDied(Exception):
    pass


class _Process:
    """One compiler process (`python -m ringserve.server.grammar_compiler`) and its pipes: one
    job at a time, each message a 4-byte length and JSON (msgpack has no integers past 64 bits)."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, setup: bytes) -> _Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ringserve.server.grammar_compiler",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self = cls(proc)
        try:
            await self._send(setup)
            await self._receive()  # ready: the tokenizer is made (~0.2 s)
        except CompilerDied as e:
            raise CompilerDied(f"the grammar compiler did not start ({e})") from None
        return self

    async def run(self, job: bytes) -> Outcome:
        await self._send(job)
        return _decode_outcome(await self._receive())

    async def _send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(len(data).to_bytes(4, "little") + data)
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise CompilerDied(await self._exit()) from None

    async def _receive(self) -> bytes:
        assert self.proc.stdout is not None
        try:
            size = int.from_bytes(await self.proc.stdout.readexactly(4), "little")
            return await self.proc.stdout.readexactly(size)
        except asyncio.IncompleteReadError:  # it died (a native crash, the OOM killer)
            raise CompilerDied(await self._exit()) from None

    async def _exit(self) -> str:
        code = await self.proc.wait()
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


class GrammarCompiler:
    def __init__(self, tokenizer_json: str, vocab_size: int | None, eos: list[int],
                 cfg: StructuredOutputsConfig):
        self._setup = _encode(_Setup(tokenizer_json, vocab_size, eos, asdict(cfg)))
        self.cfg = cfg
        self._idle: list[_Process] = []
        self._slots = asyncio.Semaphore(cfg.grammar_compile_processes)
        self._waiting = 0
        self._cache: OrderedDict[bytes, Outcome] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future] = {}
        self.compiles = 0  # jobs sent to a process (the cache's misses), for tests and logs

    async def compile(self, spec: StructuredOutputsParams, param: str) -> str:
        """The llguidance grammar of `spec`, or a 400 naming `param` (503: the queue is full)."""
        job = _encode(Job(param, spec))
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
                proc = await _Process.start(self._setup)
            except CompilerDied as e:
                log.error("%s", e)
                raise APIError(503, str(e), code="grammar_compiler_unavailable") from None
        self.compiles += 1
        timeout = self.cfg.grammar_compile_timeout
        try:
            outcome = await asyncio.wait_for(proc.run(job), timeout)
        except asyncio.TimeoutError:
            await proc.kill()
            log.warning("%s took over %s s to compile: its compiler process was killed", param,
                        timeout)
            return Outcome(error=f"{param} takes longer than {timeout:g} s to compile "
                                 f"(--grammar-compile-timeout)")
        except CompilerDied as e:
            log.warning("compiling %s crashed its compiler process (%s); a new one replaces it",
                        param, e)
            return Outcome(error=f"{param} cannot be compiled: the grammar compiler failed on "
                                 f"it ({e})")
        except BaseException:  # cancelled (client gone): its answer would come to the next job
            await asyncio.shield(proc.kill())
            raise
        self._idle.append(proc)
        return outcome

    async def close(self) -> None:
        for proc in self._idle:
            await proc.kill()
        self._idle.clear()


# --- the compiler process --------------------------------------------------------------------

class _Setup(msgspec.Struct, array_like=True):
    tokenizer_json: str
    vocab_size: int | None
    eos: list[int]
    config: dict


def _read(stream: Any) -> bytes | None:
    head = stream.read(4)
    if len(head) < 4:
        return None  # the worker is gone
    return stream.read(int.from_bytes(head, "little"))


def _write(stream: Any, data: bytes) -> None:
    stream.write(len(data).to_bytes(4, "little") + data)
    stream.flush()


def main() -> None:
    """A compiler process: make the tokenizer, then answer jobs until the worker goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when it ends
    os.nice(19)  # the lowest priority: a long compile yields the cores to the engine and workers
    threading.stack_size(COMPILE_STACK_BYTES)
    t = threading.Thread(target=_serve, args=(sys.stdin.buffer, sys.stdout.buffer),
                         name="compile")
    t.start()
    t.join()


def _serve(inp: Any, out: Any) -> None:
    from llguidance import LLExecutor

    from ringserve.ipc.structured import make_ll_tokenizer
    from ringserve.server.grammar_check import check_and_compile

    setup = msgspec.json.decode(_read(inp) or b"", type=_Setup)
    config = StructuredOutputsConfig(**setup.config)
    tokenizer = make_ll_tokenizer(setup.tokenizer_json, setup.vocab_size, setup.eos)
    executor = LLExecutor()
    decode_job = msgspec.json.Decoder(Job).decode
    _write(out, b"ready")
    while (data := _read(inp)) is not None:
        try:
            job = decode_job(data)
        except (msgspec.DecodeError, RecursionError) as e:  # the worker sent what it decoded
            _write(out, _encode(Outcome(error=f"the constraint cannot be read: {e}")))
            continue
        _write(out, _encode(check_and_compile(job, tokenizer, executor, config)))


if __name__ == "__main__":
    main()
