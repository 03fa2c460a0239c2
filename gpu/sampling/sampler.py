"""Token sampling in numpy: penalties, greedy, temperature, min_p, top_k, top_p, seeds, logprobs.

It works on a logits matrix [B, V] and per-row arrays; it knows nothing of requests. Every row
is sampled on its own (nothing is reduced across rows), with the row's own generator drawing
exactly one uniform number per sampled token, so that a seeded row gives the same tokens
whatever else is in the batch. The semantics are vLLM's:
- repetition_penalty divides positive / multiplies negative logits of every token seen in the
  prompt or the output; frequency_penalty subtracts count·f and presence_penalty subtracts p
  for every token in the output. Then banned tokens (min_tokens: eos and stop ids) get -inf.
- temperature < 1e-5 is greedy (argmax). Otherwise logits / temperature, then min_p (drop tokens
  below min_p times the top probability), top_k, top_p (the smallest set whose mass reaches p).
- structured outputs: a row's token bitmask (allowed_token_bitmask) sets -inf at every token
  its grammar does not allow, first, before the penalties.
- speculative decoding with a draft model: a row that verifies a draft token drawn from the
  draft's q keeps it or replaces it by rejection sampling (accept_or_resample); sample_draft
  draws the draft's tokens and returns their q.
- logprobs are those of the raw model distribution (log_softmax of the logits as the model gave
  them, before penalties and temperature: vLLM's default "raw_logprobs").
A row whose sampling raises (a bad id list, a parameter no check foresaw) is reported in
SamplerOutput.failed and the other rows are sampled as if it were not there: one bad request
must not cost the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence, cast

import numpy as np

# Below this temperature a row is sampled greedily (vLLM's _SAMPLING_EPS): the one definition,
# for both samplers (gpu/cuda/sampling_kernels.py) and the engine (a greedy request needs no
# generator).
GREEDY_EPS = 1e-5


@dataclass
class SamplingMetadata:
    temperature: np.ndarray                    # float32 [B]; < 1e-5: greedy
    top_k: np.ndarray                          # int32 [B]; 0: off
    top_p: np.ndarray                          # float32 [B]; 1: off
    min_p: np.ndarray                          # float32 [B]; 0: off
    generators: Sequence[np.random.Generator | None]   # [B]; None only for greedy rows
    presence_penalty: np.ndarray | None = None         # float32 [B] (None: no penalties at all)
    frequency_penalty: np.ndarray | None = None
    repetition_penalty: np.ndarray | None = None
    prompt_token_ids: Sequence[Sequence[int] | np.ndarray] | None = None  # [B] for repetition_penalty
    output_token_ids: Sequence[Sequence[int]] | None = None   # [B] for all penalties
    banned_token_ids: Sequence[Sequence[int]] | None = None   # [B] tokens that may not be sampled
    max_num_logprobs: int | None = None                # top-N logprobs per row (None: none)
    # structured outputs: int32 [B, ceil(V/32)], bit t%32 of word t//32 set = token t allowed
    # (llguidance's layout; a row of -1 allows everything). None: no row is constrained. Or a
    # function that computes it: the samplers call it (token_bitmask) only when they sample, so
    # on CUDA the host computes the masks while the device runs the step's forward (as vLLM).
    allowed_token_bitmask: np.ndarray | Callable[[], np.ndarray | None] | None = None
    # speculative decoding with a draft model: per row, the draft token it verifies and the
    # draft's distribution q it was drawn from (normalized float64 [V]; None: the row verifies
    # none, or an n-gram draft, a point mass: the row is sampled and compared, docs/speculative.md)
    draft_token_ids: Sequence[int] | None = None
    draft_probs: Sequence[np.ndarray | None] | None = None

    def token_bitmask(self) -> np.ndarray | None:
        """allowed_token_bitmask, computed now if it is a function (once)."""
        mask = self.allowed_token_bitmask
        if callable(mask):
            mask = self.allowed_token_bitmask = mask()
        return mask

    @property
    def all_greedy(self) -> bool:
        return bool(np.all(self.temperature < GREEDY_EPS))

    def penalties(self) -> Penalties | None:
        """The five penalty fields, set together (engine/sampling_metadata.py); None: none."""
        if self.presence_penalty is None:
            return None
        if (self.frequency_penalty is None or self.repetition_penalty is None
                or self.prompt_token_ids is None or self.output_token_ids is None):
            raise ValueError("SamplingMetadata: presence_penalty without the other penalty fields")
        return Penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                         self.prompt_token_ids, self.output_token_ids)


class Penalties(NamedTuple):
    presence: np.ndarray                       # float32 [B]
    frequency: np.ndarray                      # float32 [B]
    repetition: np.ndarray                     # float32 [B]
    prompt_token_ids: Sequence[Sequence[int] | np.ndarray]  # [B]
    output_token_ids: Sequence[Sequence[int]]  # [B]


@dataclass
class Logprobs:
    """Per row: the sampled token first, then the top-N (N = max_num_logprobs)."""
    token_ids: np.ndarray      # int32 [B, 1+N]
    logprobs: np.ndarray       # float32 [B, 1+N]
    sampled_rank: np.ndarray   # int32 [B]; 1 = the most likely token


@dataclass
class SamplerOutput:
    token_ids: np.ndarray              # int32 [B]
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None  # at the rows of a PromptLogprobsSpec
                                             # (gpu/sampling/prompt_logprobs.py)
    failed: dict[int, str] | None = None     # row -> why sampling it raised (its token is not one)


def each_row(rows, body, failed: dict[int, str]) -> None:
    """body(i) for every i in rows, in order; a row whose body raises goes into failed
    (row -> message, the first one kept) and the rows after it still run.
    PERF: one try around the loop, entered again after a failing row (not one per row), and
    each row runs once: a seeded row draws exactly as it would in a batch with no failure."""
    start, n = 0, len(rows)
    while start < n:
        try:
            for k in range(start, n):
                body(rows[k])
            return
        except Exception as e:  # noqa: BLE001 - reported per row, the caller ends that request
            failed.setdefault(int(rows[k]), f"{type(e).__name__}: {e}")
            start = k + 1


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float32, copy=False)
    m = x.max(axis=-1, keepdims=True)
    shifted = x - m
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def gather_logprobs(logits: np.ndarray, token_ids: np.ndarray, num_top: int) -> Logprobs:
    """Logprobs of token_ids[i] in row i, its rank, and the row's num_top best tokens."""
    lp = log_softmax(logits)
    rows = np.arange(lp.shape[0])
    chosen = lp[rows, token_ids]
    ranks = (lp > chosen[:, None]).sum(axis=-1) + 1
    ids = token_ids[:, None].astype(np.int32)
    vals = chosen[:, None]
    if num_top > 0:
        k = min(num_top, lp.shape[1])
        top = np.argpartition(-lp, k - 1, axis=-1)[:, :k]
        top_vals = np.take_along_axis(lp, top, axis=-1)
        order = np.argsort(-top_vals, axis=-1, kind="stable")
        top = np.take_along_axis(top, order, axis=-1)
        ids = np.concatenate([ids, top.astype(np.int32)], axis=1)
        vals = np.concatenate([vals, np.take_along_axis(top_vals, order, axis=-1)], axis=1)
    return Logprobs(ids, vals.astype(np.float32), ranks.astype(np.int32))


F32_MAX = np.float32(np.finfo(np.float32).max)  # the largest finite logit a penalty leaves


def apply_penalties(logits: np.ndarray, meta: SamplingMetadata,
                    failed: dict[int, str] | None = None) -> np.ndarray:
    """Penalties and bans, in place on a float32 copy the caller owns. failed: where a row
    that raises is reported (the others go on); None: raise."""
    vocab = logits.shape[1]
    report: dict[int, str] = {} if failed is None else failed
    pen, banned_ids = meta.penalties(), meta.banned_token_ids
    if pen is not None:
        presence, frequency, repetition, prompts, outputs = pen

        def penalize(i: int) -> None:
            rep = float(repetition[i])
            freq = float(frequency[i])
            pres = float(presence[i])
            if rep == 1.0 and freq == 0.0 and pres == 0.0:
                return
            out = np.asarray(outputs[i], dtype=np.int64)
            row = logits[i]
            if rep != 1.0:
                seen = np.zeros(vocab, dtype=bool)
                seen[np.asarray(prompts[i], dtype=np.int64)] = True
                seen[out] = True
                # NOTE: a positive logit over a tiny penalty (1e-38 is valid) stays finite: +inf would
                # make the softmax NaN and leave top_p nothing to keep
                vals = row[seen]  # NOTE: one gather, not three
                with np.errstate(over="ignore"):
                    row[seen] = np.where(vals > 0, np.minimum(vals / rep, F32_MAX), vals * rep)
            if freq != 0.0 or pres != 0.0:
                counts = np.bincount(out, minlength=vocab)[:vocab]
                row -= freq * counts + pres * (counts > 0)
        each_row(range(logits.shape[0]), penalize, report)
    if banned_ids is not None:
        def ban(i: int) -> None:
            banned = banned_ids[i]
            if len(banned):
                logits[i, np.asarray(banned, dtype=np.int64)] = -np.inf
        each_row(range(len(banned_ids)), ban, report)
    if failed is None and report:
        raise ValueError(f"row {next(iter(report))}: {next(iter(report.values()))}")
    return logits


def apply_token_bitmask(logits: np.ndarray, mask: np.ndarray) -> None:
    """-inf, in place, at every token a row's bitmask does not allow (structured outputs).
    PERF: only the constrained rows (not all -1) are unpacked: one unpackbits each, [V] bytes."""
    vocab = logits.shape[1]
    for i in np.flatnonzero((mask != -1).any(axis=1)):
        allowed = np.unpackbits(mask[i].view(np.uint8), bitorder="little")[:vocab]
        logits[i, allowed == 0] = -np.inf


def row_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                     min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The tokens one row of logits (float32 [V]) may draw and their probabilities (float64,
    not normalized): temperature, top_k, min_p, top_p."""
    x = logits.astype(np.float64) / temperature
    ids = np.arange(x.shape[0])
    if top_k > 0 and top_k < x.shape[0]:
        ids = np.argpartition(-x, top_k - 1)[:top_k]
        x = x[ids]
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if min_p > 0.0:
        probs = np.where(probs < min_p * probs.max(), 0.0, probs)
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_p = probs[order] / probs.sum()
        before = np.cumsum(sorted_p) - sorted_p        # mass of the tokens ranked above
        keep = order[before < top_p]                   # always keeps the top token
        ids, probs = ids[keep], probs[keep]
    return ids, probs


def draw(ids: np.ndarray, probs: np.ndarray, generator: np.random.Generator) -> int:
    """One token of ids with probabilities probs (not normalized): one uniform number."""
    return pick(ids, probs, generator.random())


def pick(ids: np.ndarray, probs: np.ndarray, u: float) -> int:
    """The token of ids at u in [0, 1) of the CDF of probs (not normalized), in ids' order."""
    cdf = np.cumsum(probs)
    j = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(cdf) - 1)
    return int(ids[j])


def dense_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                       min_p: float) -> np.ndarray:
    """row_distribution as a normalized float64 [V] vector (speculative decoding's p and q)."""
    ids, probs = row_distribution(logits, temperature, top_k, top_p, min_p)
    dense = np.zeros(logits.shape[0], np.float64)
    dense[ids] = probs / probs.sum()
    return dense


def sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
               generator: np.random.Generator) -> int:
    """One random token from one row of logits (float32 [V])."""
    return draw(*row_distribution(logits, temperature, top_k, top_p, min_p), generator)


def accept_or_resample(p: np.ndarray, draft: int, q: np.ndarray,
                       generator: np.random.Generator) -> int:
    """Speculative decoding's rejection sampling (Leviathan et al.; vLLM's RejectionSampler):
    the draft token, drawn from the draft's q, is kept with probability min(1, p/q) at it;
    otherwise a token from normalize(max(p - q, 0)), which is never the draft. The token that
    comes out follows p whatever q is. p, q: normalized float64 [V]. Two uniform numbers,
    drawn first whatever the outcome: the device sampler draws a row's numbers on the host
    before the step (gpu/cuda/sampler.py draw_uniforms), so both backends take the same ones."""
    u, u_residual = generator.random(), generator.random()
    # NOTE: u * q < p, not u < p / q: q(draft) > 0 (it was drawn), and no division
    if u * q[draft] < p[draft]:
        return draft
    residual = np.maximum(p - q, 0.0)
    if residual.sum() <= 0.0:   # p == q up to rounding: the rejection had probability ~0
        residual = p
    nonzero = np.flatnonzero(residual)
    return pick(nonzero, residual[nonzero], u_residual)


def processed_logits(logits: np.ndarray, meta: SamplingMetadata, failed: dict[int, str]) -> np.ndarray:
    """logits with the rows' grammar masks, penalties and bans applied (a copy when any)."""
    mask = meta.token_bitmask()
    if meta.presence_penalty is None and meta.banned_token_ids is None and mask is None:
        return logits
    x = np.array(logits, dtype=np.float32)  # our own copy: penalties and masks work in place
    if mask is not None:
        apply_token_bitmask(x, mask)
    apply_penalties(x, meta, failed)
    return x


def sample(logits: np.ndarray, meta: SamplingMetadata) -> SamplerOutput:
    """Sample one token per row of logits [B, V]. A row that raises is reported in .failed.
    A row verifying a draft model's token (meta.draft_probs) keeps it or replaces it by
    rejection sampling (accept_or_resample); a greedy row is its argmax either way."""
    raw = logits
    failed: dict[int, str] = {}
    x = processed_logits(logits, meta, failed)
    token_ids = x.argmax(axis=-1).astype(np.int32)
    if not meta.all_greedy:
        qs, drafts = meta.draft_probs, meta.draft_token_ids

        def draw_row(i: int) -> None:
            t, k, p, m = float(meta.temperature[i]), int(meta.top_k[i]), float(meta.top_p[i]), \
                float(meta.min_p[i])
            gen = cast(np.random.Generator, meta.generators[i])  # not greedy: set
            q = None if qs is None else qs[i]
            if q is None:
                token_ids[i] = sample_row(x[i], t, k, p, m, gen)
            else:
                token_ids[i] = accept_or_resample(dense_distribution(x[i], t, k, p, m),
                                                  int(drafts[i]), q, gen)  # type: ignore[index]
        each_row(np.flatnonzero(meta.temperature >= GREEDY_EPS), draw_row, failed)
    lps = None
    if meta.max_num_logprobs is not None:
        try:
            lps = gather_logprobs(raw, token_ids, meta.max_num_logprobs)
        except Exception:  # noqa: BLE001 - find the row(s): rare, so row by row
            lps = _gather_rows(raw, token_ids, meta.max_num_logprobs, failed)
    return SamplerOutput(token_ids, lps, failed=failed or None)


def sample_draft(logits: np.ndarray, meta: SamplingMetadata
                 ) -> tuple[np.ndarray, list[np.ndarray | None], dict[int, str]]:
    """A draft model's tokens, one per row, and the distribution q each was drawn from (None
    for a greedy row: q is its argmax), for the target's rejection sampling; rows that raised."""
    failed: dict[int, str] = {}
    x = processed_logits(logits, meta, failed)
    token_ids = x.argmax(axis=-1).astype(np.int32)
    probs: list[np.ndarray | None] = [None] * len(token_ids)

    def draw_row(i: int) -> None:
        q = dense_distribution(x[i], float(meta.temperature[i]), int(meta.top_k[i]),
                               float(meta.top_p[i]), float(meta.min_p[i]))
        nonzero = np.flatnonzero(q)
        token_ids[i] = draw(nonzero, q[nonzero], cast(np.random.Generator, meta.generators[i]))
        probs[i] = q
    each_row(np.flatnonzero(meta.temperature >= GREEDY_EPS), draw_row, failed)
    return token_ids, probs, failed


def _gather_rows(logits: np.ndarray, token_ids: np.ndarray, num_top: int,
                 failed: dict[int, str]) -> Logprobs:
    """gather_logprobs one row at a time; a row that raises gets the top token's logprob
    (it is reported in failed, so nobody reads it)."""
    k = min(num_top, logits.shape[1]) if num_top > 0 else 0
    out = Logprobs(np.zeros((len(token_ids), 1 + k), np.int32),
                   np.zeros((len(token_ids), 1 + k), np.float32), np.ones(len(token_ids), np.int32))

    def gather(i: int) -> None:
        one = gather_logprobs(logits[i:i + 1], token_ids[i:i + 1], num_top)
        out.token_ids[i], out.logprobs[i], out.sampled_rank[i] = \
            one.token_ids[0], one.logprobs[0], one.sampled_rank[0]

    each_row(range(len(token_ids)), gather, failed)
    return out


@dataclass
class CompletedStep:
    """A step whose sampled tokens are already on the host: the CPU backend computes in submit
    (the CUDA backend returns a gpu.cuda.sampler.PendingSample with the same result())."""
    output: SamplerOutput

    def result(self) -> SamplerOutput:
        return self.output


def sample_on_host(logits: np.ndarray, rows: np.ndarray, metadata: SamplingMetadata) -> CompletedStep:
    """Sample `rows` of host logits [B, V] with sample() (the CPU backend's submit)."""
    if len(rows) == 0:
        return CompletedStep(SamplerOutput(np.zeros(0, np.int32)))
    if len(rows) < len(logits):
        logits = logits[rows]
    return CompletedStep(sample(logits, metadata))
