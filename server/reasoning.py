"""Reasoning output as vLLM serves it (``--reasoning-parser``): the model's ``<think>…</think>``
goes into ``message.reasoning_content`` (streamed as ``delta.reasoning_content``), the rest is
the content, which a tool-call parser then reads (server/tool_calls.py).

- ``qwen3``: reasoning only after an opening ``<think>`` (text before it is content; without
  it, everything is content, as with ``enable_thinking: false``).
- ``deepseek_r1``: the output begins in reasoning (DeepSeek-R1's template writes ``<think>``
  into the prompt); a leading ``<think>`` is dropped; everything before ``</think>`` is
  reasoning, and an output without ``</think>`` is all reasoning.
An output cut short inside its reasoning (``max_tokens``) has reasoning and no content.
A grammar (structured outputs) constrains the whole output from its first token, not only
after ``</think>`` as vLLM's does: so a constrained output is split only where it spells an
opening ``<think>`` (qwen3's rule for both), else a JSON answer under deepseek_r1 would all be
taken for reasoning.
Streamed and whole outputs split the same way: a whole text is one push of a ReasoningStream.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    starts_in_reasoning: bool  # deepseek_r1: text before </think> is reasoning without <think>


REASONING_PARSERS = {
    "qwen3": ReasoningFormat("<think>", "</think>", starts_in_reasoning=False),
    "deepseek_r1": ReasoningFormat("<think>", "</think>", starts_in_reasoning=True),
}


def reasoning_format(parser: str | None, constrained: bool) -> ReasoningFormat | None:
    """The format a request's output is split by (None: no --reasoning-parser)."""
    fmt = REASONING_PARSERS.get(parser or "")
    if fmt is not None and constrained:
        return replace(fmt, starts_in_reasoning=False)
    return fmt


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of text that begins marker (held back: it may complete)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ReasoningStream:
    """One choice's text, delta by delta, into (reasoning, content) pieces."""
    fmt: ReasoningFormat
    state: str = "start"      # "start" (nothing decided yet), "reasoning" or "content"
    pending: str = ""         # text held back: it may be the beginning of a marker
    reasoned: bool = False    # the output has had a reasoning part

    def push(self, delta: str, final: bool = False) -> tuple[str, str]:
        """This delta's (reasoning, content); final: the output ended, nothing is held back."""
        self.pending += delta
        reasoning, content = "", ""
        while self.pending:
            if self.state == "content":
                content, self.pending = content + self.pending, ""
            elif self.state == "start":
                start = self.fmt.start
                if self.fmt.starts_in_reasoning:  # only a leading <think> is a marker
                    if self.pending.startswith(start) or not start.startswith(self.pending) or final:
                        self.pending = self.pending.removeprefix(start)
                        self.state, self.reasoned = "reasoning", True
                        continue
                    break
                at = self.pending.find(start)
                if at >= 0:
                    content += self.pending[:at]
                    self.pending = self.pending[at + len(start):]
                    self.state, self.reasoned = "reasoning", True
                    continue
                keep = 0 if final else _partial(self.pending, start)
                content += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                break
            else:
                at = self.pending.find(self.fmt.end)
                if at >= 0:
                    reasoning += self.pending[:at]
                    self.pending = self.pending[at + len(self.fmt.end):]
                    self.state = "content"
                    continue
                keep = 0 if final else _partial(self.pending, self.fmt.end)
                reasoning += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                break
        return reasoning, content


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning_content, content): reasoning None where there was none,
    content None where the reasoning left nothing after it."""
    stream = ReasoningStream(fmt)
    reasoning, content = stream.push(text, final=True)
    if not stream.reasoned:
        return None, content
    return reasoning, content or None
