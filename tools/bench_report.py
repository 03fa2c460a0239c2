"""The one way a benchmark under tools/ prints its table and writes `--json FILE`.

A tool calls `add_json_argument(parser)`, `run = BenchRun.start("bench_x", args)` before it
measures (the date and the load average before), and at the end prints `table(rows, columns)`
(aligned, a markdown table that pastes into docs/ as it is) and calls `run.write(args.json,
rows)`, which adds the load average after. Rows are dicts of plain values, the same in the
table and in the JSON; ratios against a peer measured in the same run are columns like any
other.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

FORMAT = "ringserve-bench/1"


@dataclass(frozen=True)
class Column:
    """One table column: the row key it shows, its header, a format spec (".3f", "d") and
    its alignment (">" right, for numbers; "<" left, for names)."""
    key: str
    title: str
    fmt: str = ""
    align: str = ">"

    def cell(self, row: dict[str, Any]) -> str:
        value = row.get(self.key)
        return "-" if value is None else format(value, self.fmt)


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[str]],
                   align: Sequence[str] | None = None) -> str:
    """Cells already formatted; columns padded to their widest cell, right-aligned unless
    align gives "<" for a column."""
    align = align or [">"] * len(head)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(f"{c:{a}{w}}" for c, a, w in zip(r, align, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" if a == ">" else ":" + "-" * (w + 1)
                         for a, w in zip(align, widths, strict=True)) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """The rows as a markdown table, one column per Column."""
    return markdown_table([c.title for c in columns], [[c.cell(r) for c in columns] for r in rows],
                          [c.align for c in columns])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    return {"cpu_model": cpu_model(), "cores": len(os.sched_getaffinity(0)),
            "logical_cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write the run (machine, load, arguments, rows) here as JSON")


def _public(name: str, value: Any) -> Any:
    """An argument as the JSON may show it: paths as text, secrets (`--api-key`) withheld."""
    if value is not None and any(w in name for w in ("key", "secret", "password")):
        return "<withheld>"
    return str(value) if isinstance(value, Path) else value


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class BenchRun:
    """What a run records besides its rows: started before measuring, so that the load
    average before is the machine's, not the benchmark's."""
    tool: str
    args: dict[str, Any]
    date: str
    machine: dict[str, Any]
    load_before: list[float]
    load_after: list[float] = field(default_factory=list)

    @classmethod
    def start(cls, tool: str, args: argparse.Namespace | dict[str, Any]) -> BenchRun:
        a = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
        return cls(tool, {k: _public(k, v) for k, v in a.items()},
                   datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                   machine_info(), _load())

    def finish(self) -> None:
        """Note the load average after (write() does it if not done)."""
        self.load_after = _load()

    def header(self) -> str:
        """One line to print above the table: the date, the machine and the load."""
        if not self.load_after:
            self.finish()
        m = self.machine
        return (f"{self.tool}  {self.date}  {m['cpu_model']}, {m['cores']} core(s); load average "
                f"{self.load_before[0]:.2f} before, {self.load_after[0]:.2f} after")

    def document(self, rows: Sequence[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        if not self.load_after:
            self.finish()
        return {"format": FORMAT, "tool": self.tool, "date": self.date, "machine": self.machine,
                "load_average_before": self.load_before, "load_average_after": self.load_after,
                "args": self.args, "rows": list(rows), **extra}

    def write(self, path: Path | None, rows: Sequence[dict[str, Any]], **extra: Any) -> None:
        """Write the JSON document to path (nothing when path is None)."""
        if path is not None:
            Path(path).write_text(json.dumps(self.document(rows, **extra), indent=2) + "\n")


def read_bandwidth() -> float:
    """Single-thread read bandwidth in bytes/s: the best of 5 streaming reads of 256 MiB.

    A vectorized XOR of 64-bit words (36 GB/s on the 2-core VM), not numpy's float32 sum, whose
    pairwise summation reads at ~20 GB/s: the int8 kernels read faster than that, so a numpy-sum
    roofline would not bound them. (numba and numpy imported here: the HTTP tools need neither.)"""
    import numba
    import numpy as np

    @numba.njit(nogil=True)
    def xor_words(a: np.ndarray) -> np.uint64:  # pragma: no cover - compiled
        acc = np.uint64(0)
        for i in range(a.size):  # integer XOR: LLVM vectorizes it with no reassociation flags
            acc ^= a[i]
        return acc
    a = np.ones(1 << 25, dtype=np.uint64)
    xor_words(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        xor_words(a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best
