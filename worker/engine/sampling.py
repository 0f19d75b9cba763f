"""Sampling for a whole decode step at once: numpy over llama.cpp's logits matrix, one row per sequence.

Owns: choosing each row's next token (greedy, or top-k, top-p, temperature and a seeded draw), the
chosen token's probability, and each request's random generator.
Must not: touch the batch, the context or the KV cache; it reads a logits matrix it is handed (a view
of llama.cpp's buffer, no copy) and writes nothing into it. Used only on the engine thread.

The rules are llama.cpp's sampler chain, which the worker used before (one `llama_sampler_sample` per
sequence, each building a candidate array of the whole vocabulary): banned tokens get -inf, then top-k,
then top-p over the softmax of what is left (the smallest set of most likely tokens whose probability
reaches p), then the temperature, then one draw from the softmax of the rest. Greedy is the first
largest logit of the row with banned tokens excluded, exactly as llama.cpp's greedy sampler picks it.
A seeded request's draws are a pure function of (seed, the position of the token drawn among the
generated ones, which draw for that token): `position_uniform`, a splitmix64 hash. A request repeats
itself whatever else runs beside it and however many draws a token took (a constrained re-pick draws
twice, a row drawn alone once), and a continuation on another worker (protocol.worker.GenerateRequest.
generated) draws at position k exactly what the first worker would have drawn there. An unseeded
request draws from numpy's generator, seeded from fresh entropy. The draws are not llama.cpp's (its
generator is a different one), only their distribution is the same.

The probability reported with each token is its softmax under the raw logits (before bans, top-k,
top-p or temperature): float32 exp of (logit - row max), summed. That sum over the vocabulary is most
of the work per row: numpy's float32 exp is not vectorised on an AVX2 machine (1.5-3.5 ns an element,
75-170 us for a 49,152-token vocabulary). llama.cpp's CPU library exports its own vectorised softmax
kernel (`ggml_vec_soft_max_f32`: exp of x - max into a scratch row, the sum in double), about 3x faster
here; `ggml_exp_sum` finds it, checks it against numpy on a test row, and numpy stands in when it is
missing or disagrees. Every other step is a single pass over the matrix or over a row, or work on a few
candidates. The rows that only sample with top-k (most requests: nothing banned, biased or
constrained) are drawn side by side, a group of rows per k, with fixed-size array operations over the
group (`top_k_rows`, `_draw_rows`); their one pass over the row also gives its largest logit, so they
need no argmax pass of their own (`_argmax` passes over the rows that do). A row that is biased,
penalised or constrained and samples with top-k finds its top-k alone by one comparison against a
threshold from a strided sample (`_top_k`). Only a request without top-k, or one whose top-k
keeps the whole vocabulary, pays for full-row selection.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from protocol.seeds import choice_seed  # noqa: F401 - re-exported: each choice's seed, shared with the coordinator
from worker.engine.scoring import log_normalizers, most_likely
from worker.errors import ConstraintError

log = logging.getLogger("worker.engine.sampling")
# (row, its max, float32 scratch of at least the row's size) -> sum of exp(row - max); writes scratch.
ExpSum = Callable[[np.ndarray, float, np.ndarray], float]

# Top-p without top-k looks for the nucleus among this many of the most likely tokens first, and
# only widens the search (x4 each time) when they do not reach p: sorting the whole vocabulary per
# row would cost more than the rest of the step.
NUCLEUS_FIRST_GUESS = 64
# Top-k's threshold comes from every 16th logit of a row (see `_top_k`): 2,000 of a 32,000 vocabulary.
TOP_K_SAMPLE_STRIDE = 16
# Top-k for a step's sampling rows together sees each row as groups of this many tokens (`top_k_rows`).
TOP_K_GROUPS = 16
NO_TOKENS = np.empty(0, dtype=np.intp)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    banned_tokens: tuple[int, ...] = ()  # end-of-generation tokens when ignore_eos is asked
    probability: bool = True  # False: the chosen token's probability is not computed (NOT_COMPUTED)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit); -100 bans it in effect
    presence_penalty: float = 0.0  # taken off the logit of every token generated so far
    frequency_penalty: float = 0.0  # taken off once per time a token was generated so far
    repeat_penalty: float = 1.0  # llama.cpp's: divides a positive logit (multiplies a negative) of a recent token
    repeat_last_n: int = 64  # the recent tokens repeat_penalty looks at, the prompt's included

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


NOT_COMPUTED = math.nan  # the probability of a row whose request did not ask for it

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: 64 bits in, 64 well-mixed bits out."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int, draw: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, the generated token's position, the draw's
    number for that token): a seeded request's draws, the same on any worker (53 bits, as numpy's)."""
    return (_mix64(_mix64(_mix64(seed) ^ position) ^ draw) >> 11) * (1.0 / (1 << 53))


class Constraint(Protocol):
    """What may come next in a constrained sequence (worker/engine/grammar.py's `Grammar`)."""

    end: int  # the token that ends the answer when the grammar allows nothing more

    def allows(self, token: int) -> bool: ...
    def mask(self, row: np.ndarray, out: np.ndarray) -> np.ndarray: ...
    def accept(self, token: int) -> None: ...


def replay(constraint: Constraint, tokens: Sequence[int]) -> None:
    """Advances a grammar over tokens generated before (a continuation's `generated`) as if this worker had
    chosen them; `ConstraintError` naming the first one it does not allow (nothing may then continue)."""
    for i, token in enumerate(tokens):
        if not constraint.allows(token):
            raise ConstraintError(f"generated.{i}: token {token} is not allowed by the request's grammar there")
        constraint.accept(token)


def _unseeded(seed: int | None) -> np.random.Generator | None:
    """An unseeded request's generator, of fresh entropy; None for a seeded one (`position_uniform`)."""
    return np.random.default_rng() if seed is None else None


class RequestSampling:
    """One request's sampling parameters, its draws (a seeded request's by position, `position_uniform`;
    an unseeded one's from its own generator of fresh entropy), and its grammar when it has one.
    `generated`: tokens an earlier worker generated (a continuation): the penalties count them and the
    draws go on at their position; the grammar is the caller's to advance (`replay`)."""

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None,
                 prompt: Sequence[int] = (), generated: Sequence[int] = ()) -> None:
        self.params = params
        self.banned = np.array(params.banned_tokens, dtype=np.intp)
        self.rng = _unseeded(params.seed)
        self.position = len(generated)  # the position among generated tokens of the token drawn next
        self.draws = 0  # draws made for that token so far
        self.constraint = constraint
        self.bias_ids = np.array([t for t, _ in params.logit_bias], dtype=np.intp)
        self.bias = np.array([b for _, b in params.logit_bias], dtype=np.float32)
        self.penalised = bool(params.presence_penalty or params.frequency_penalty)
        repeats = params.repeat_penalty != 1.0 and params.repeat_last_n > 0
        # The latest tokens, the prompt's last ones first, kept only with a repetition penalty.
        self.recent: collections.deque[int] | None = (
            collections.deque(prompt[-params.repeat_last_n:], maxlen=params.repeat_last_n) if repeats else None)
        self.adjusted = self.penalised or repeats or bool(params.logit_bias)
        self.generated: dict[int, int] = {}  # token -> times generated, kept only with a penalty
        exact = not (self.adjusted or constraint is not None)  # the row's logits are used as they are
        self.plain = params.greedy and exact and not self.banned.size
        self.top_k_only = not params.greedy and params.top_k > 0 and exact
        # Greedy with nothing to adjust, constrain or compute beyond the pick (banned tokens aside): a
        # step of such rows takes one argmax over the matrix and no other work per row (`StepSampler`).
        self.quick = params.greedy and exact and not params.probability
        self.banned_set = frozenset(params.banned_tokens)
        self._count(generated)

    def _count(self, generated: Sequence[int]) -> None:
        """Tokens an earlier worker generated, counted as if chosen here: the repetition window runs over the
        prompt, then them; the presence and frequency penalties count them."""
        if self.recent is not None:
            self.recent.extend(generated)
        if self.penalised:
            for token in generated:
                self.generated[token] = self.generated.get(token, 0) + 1

    def uniform(self) -> float:
        """The next draw for the token at `position`."""
        if self.rng is not None:
            return float(self.rng.random())
        self.draws += 1
        assert self.params.seed is not None
        return position_uniform(self.params.seed, self.position, self.draws - 1)

    def drawn(self) -> None:
        """The token at `position` is chosen: the next draws are the next position's."""
        self.position += 1
        self.draws = 0

    def adjust(self, row: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`row` with the request's logit bias and penalties applied, written into `out`, in llama.cpp's
        order: the bias; then the repetition penalty over the latest tokens (a positive logit divided
        by it, a negative one multiplied); then OpenAI's rule, logit - count x frequency_penalty -
        (count > 0) x presence_penalty, over the tokens generated so far."""
        adjusted = out[:row.size]
        np.copyto(adjusted, row)
        if self.bias_ids.size:
            adjusted[self.bias_ids] += self.bias
        if self.recent:
            ids = np.fromiter(set(self.recent), dtype=np.intp)
            values = adjusted[ids]
            penalty = np.float32(self.params.repeat_penalty)
            adjusted[ids] = np.where(values > 0, values / penalty, values * penalty)
        if self.generated:
            ids = np.fromiter(self.generated, dtype=np.intp, count=len(self.generated))
            counts = np.fromiter(self.generated.values(), dtype=np.float32, count=len(self.generated))
            adjusted[ids] -= counts * self.params.frequency_penalty + self.params.presence_penalty
        return adjusted

    def chose(self, token: int) -> None:
        if self.penalised:
            self.generated[token] = self.generated.get(token, 0) + 1
        if self.recent is not None:
            self.recent.append(token)


def numpy_exp_sum(row: np.ndarray, top: float, scratch: np.ndarray) -> float:
    out = scratch[:row.size]
    np.subtract(row, np.float32(top), out=out)
    np.exp(out, out=out)
    return float(out.sum())


def ggml_exp_sum(library_dir: Path | None = None) -> ExpSum | None:
    """llama.cpp's vectorised softmax kernel from the ggml CPU library next to llama_cpp, when it is
    there and agrees with numpy on a test row; else None."""
    if library_dir is None:
        try:
            import llama_cpp
        except ImportError:
            return None
        library_dir = Path(llama_cpp.__file__).parent / "lib"
    for path in sorted(library_dir.glob("*ggml-cpu*")):
        try:
            kernel = ctypes.CDLL(str(path)).ggml_vec_soft_max_f32
        except (OSError, AttributeError):
            continue
        kernel.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float]
        kernel.restype = ctypes.c_double

        def exp_sum(row: np.ndarray, top: float, scratch: np.ndarray, kernel: Any = kernel) -> float:
            if row.dtype != np.float32 or not row.flags.c_contiguous:
                return numpy_exp_sum(row, top, scratch)
            return float(kernel(row.size, scratch.ctypes.data, row.ctypes.data, top))

        if _agrees(exp_sum):
            return exp_sum
        log.warning("ggml_vec_soft_max_f32 in %s disagrees with numpy; sampling with numpy", path)
    return None


def _agrees(exp_sum: ExpSum) -> bool:
    row = (np.random.default_rng(0).standard_normal(4099) * 4).astype(np.float32)
    top = float(row.max())
    scratch = np.empty(row.size, dtype=np.float32)
    exps = np.exp(row.astype(np.float64) - top)
    expected = float(exps.sum())
    got = exp_sum(row, top, scratch)
    return abs(got - expected) <= 1e-6 * expected and bool(np.allclose(scratch, exps, rtol=1e-5, atol=0))


def top_alternatives(row: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The `k` most likely tokens of a row of raw logits, most likely first, each with its log-probability
    (log-softmax over the whole row): OpenAI's `top_logprobs`. A token the model rules out (-inf) reads
    -9999.0, as OpenAI's API reports one: JSON has no infinity."""
    return most_likely(row, k, float(log_normalizers(row[None, :])[0]))


class StepSampler:
    """Samples one token for every row of a step's logits; holds only scratch space between steps."""

    def __init__(self, n_vocab: int, exp_sum: ExpSum | None = None) -> None:
        self._scratch = np.empty(n_vocab, dtype=np.float32)
        self._masked = np.empty(n_vocab, dtype=np.float32)  # a constrained row's logits, masked
        self._adjusted = np.empty(n_vocab, dtype=np.float32)  # a row with its bias and penalties
        self._exp_sum_of = exp_sum or ggml_exp_sum() or numpy_exp_sum

    def sample(self, logits: np.ndarray, requests: Sequence[RequestSampling]) -> list[tuple[int, float]]:
        """`logits` is (len(requests), n_vocab) float32, row i for requests[i]; returns (token, probability)
        per row."""
        if all(request.quick for request in requests):
            return self._quick(logits, requests)
        drawn = self._draw_side_by_side(logits, requests)  # row -> (token, the row's largest logit)
        best = self._argmax(logits, [i for i in range(len(requests)) if i not in drawn])
        out = []
        for i, request in enumerate(requests):
            row = logits[i]
            if i in drawn:
                token, top = drawn[i]
            else:
                token = best[i] if request.plain else self._special(row, best[i], request)
                top = float(row[best[i]])
            if request.params.probability:  # the whole vocabulary's softmax denominator: most of a row's cost
                out.append((token, min(1.0, math.exp(float(row[token]) - top) / self._exp_sum(row, top))))
            else:
                out.append((token, NOT_COMPUTED))
            request.drawn()
        return out

    def _quick(self, logits: np.ndarray, requests: Sequence[RequestSampling]) -> list[tuple[int, float]]:
        """A step whose rows are all `quick`: each row's largest logit, from one pass over the matrix; a
        row whose pick is a token it bans picks again from its own row without them."""
        tokens = logits.argmax(axis=1).tolist()
        for i, request in enumerate(requests):
            if tokens[i] in request.banned_set:
                tokens[i] = self._pick(logits[i], tokens[i], request)
        return [(token, NOT_COMPUTED) for token in tokens]

    @staticmethod
    def _argmax(logits: np.ndarray, rows: list[int]) -> dict[int, int]:
        """Each of `rows`' first largest logit: one pass over the matrix when every row needs it (a step
        of greedy rows), else a pass over each row that does; rows drawn side by side need none."""
        if len(rows) == logits.shape[0]:
            return dict(enumerate(logits.argmax(axis=1).tolist()))
        return {i: int(logits[i].argmax()) for i in rows}

    def _draw_side_by_side(self, logits: np.ndarray,
                           requests: Sequence[RequestSampling]) -> dict[int, tuple[int, float]]:
        """The tokens of the rows that sample with top-k and are neither adjusted nor constrained, drawn
        together, a group per k: row -> (token, the row's largest logit). Each of those rows costs a few
        array operations on the whole group instead of twenty-odd calls of its own (`top_k_rows`,
        `_draw_rows`), and no pass of its own for its largest logit."""
        groups: dict[int, list[int]] = {}
        for i, request in enumerate(requests):
            if request.top_k_only and request.params.top_k + request.banned.size <= logits.shape[1] // TOP_K_GROUPS:
                groups.setdefault(request.params.top_k, []).append(i)
        drawn: dict[int, tuple[int, float]] = {}
        for k, rows in groups.items():
            picked = [requests[i] for i in rows]
            banned = np.full((len(rows), max(r.banned.size for r in picked)), -1, dtype=np.intp)
            for line, request in zip(banned, picked, strict=True):
                line[:request.banned.size] = request.banned
            ids, kept, tops = top_k_rows(logits, np.array(rows, dtype=np.intp), k, banned)
            tokens = _draw_rows(ids, kept, picked)
            for i, request, token, top in zip(rows, picked, tokens, tops.tolist(), strict=True):
                if token < 0:  # the row's k-th logit is -inf: ties among -inf need the row's own order
                    token = self._draw(logits[i], request)
                drawn[i] = (token, top)
        return drawn

    def _special(self, row: np.ndarray, best: int, request: RequestSampling) -> int:
        """A row that samples, bans tokens, is adjusted (bias, penalties) or constrained (grammar)."""
        if request.adjusted:  # only rows with a bias or a penalty pay for a copy of their row
            row = request.adjust(row, self._adjusted)
            best = int(row.argmax())
        token = self._pick(row, best, request)
        if request.constraint is not None:
            token = self._constrained(row, token, request, request.constraint)
        request.chose(token)
        return token

    def _pick(self, row: np.ndarray, best: int, request: RequestSampling) -> int:
        if not request.params.greedy:
            return self._draw(row, request)
        if request.banned.size and best in request.params.banned_tokens:
            return int(self._without_banned(row, request.banned).argmax())
        return best

    def _constrained(self, row: np.ndarray, token: int, request: RequestSampling, constraint: Constraint) -> int:
        """The pick when the grammar allows it (one token checked); else the pick again from the row
        masked to what the grammar allows. The grammar then advances by the token chosen."""
        if not constraint.allows(token):
            masked = constraint.mask(row, self._masked)
            best = int(masked.argmax())
            if not math.isfinite(float(masked[best])):
                return constraint.end  # nothing may follow: end the answer (never accept a rejected token)
            token = self._pick(masked, best, request)
            if not math.isfinite(float(masked[token])):
                token = best
        constraint.accept(token)
        return token

    def _exp_sum(self, row: np.ndarray, top: float) -> float:
        """Sum of exp(logit - top) over the row: the raw softmax's denominator."""
        return self._exp_sum_of(row, top, self._scratch)

    def _without_banned(self, row: np.ndarray, banned: np.ndarray) -> np.ndarray:
        copy = self._scratch
        np.copyto(copy, row)
        copy[banned] = -np.inf
        return copy

    def _draw(self, row: np.ndarray, request: RequestSampling) -> int:
        params = request.params
        ids, kept = support(row, params.top_k, params.top_p, banned=request.banned, scratch=self._scratch)
        scaled = kept.astype(np.float64) / params.temperature
        weights = np.exp(scaled - scaled.max())
        cumulative = np.cumsum(weights)
        pick = int(np.searchsorted(cumulative, request.uniform() * cumulative[-1], side="right"))
        return int(ids[min(pick, len(ids) - 1)])


def support(row: np.ndarray, top_k: int, top_p: float, *, banned: np.ndarray = NO_TOKENS,
            scratch: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The tokens that top-k then top-p leave of one row, and their logits; `banned` tokens never.

    With top-k, the vocabulary is passed over once, by one comparison (`_top_k`); softmax, top-p and
    the draw then work on the k survivors only. Without it, the whole row: with neither cut it comes
    back in token order (banned tokens at -inf, in `scratch` when given, weigh nothing in the draw);
    otherwise the kept tokens, most likely first."""
    allowed = row.size - banned.size
    k = min(top_k, allowed) if top_k > 0 else allowed
    if k < allowed:  # top-p's softmax is over what top-k left, at the logits as they are
        ids = _top_k(row, k, banned)
        if top_p >= 1.0:
            return ids, row[ids]
        probs = np.exp(row[ids] - row[ids[0]])
        cut = _nucleus(probs / probs.sum(), top_p)
        return ids[:cut], row[ids[:cut]]
    if banned.size:
        masked = np.empty_like(row) if scratch is None else scratch[:row.size]
        np.copyto(masked, row)
        masked[banned] = -np.inf
        row = masked
    if top_p >= 1.0:
        return np.arange(row.size), row
    # Softmax over the whole row, its denominator summed in token order in float32 as llama.cpp sums
    # it: with p near 1 the cut falls among tokens of about 1e-6 each, where a more exact sum keeps a
    # few percent more tokens than llama.cpp does. A cumulative sum is numpy's sequential one.
    top = np.float32(row.max())
    total = np.cumsum(np.exp(row - top))[-1]
    guess = NUCLEUS_FIRST_GUESS
    while True:
        ids = _largest(row, min(guess, allowed))
        probs = np.exp(row[ids] - top) / total
        if probs.sum() >= top_p or guess >= allowed:
            cut = _nucleus(probs, top_p)
            return ids[:cut], row[ids[:cut]]
        guess *= 4


def _top_k(row: np.ndarray, k: int, banned: np.ndarray) -> np.ndarray:
    """Indices of the k largest values of `row` not `banned`, largest first (ties: lower token id first),
    for one comparison pass over the row instead of a selection over all of it (14.5 us against 39.6
    for a 32,000-token row here: `python -m bench.sampler_bench`, retired in 7737c5b: `git show
    7737c5b:bench/sampler_bench.py`). The threshold is the (k + banned)-th largest value of a strided
    sample of the row: at least that many of the row's tokens reach it (the sample's own), so every one
    of the k largest allowed tokens does too, and the exact selection is made among the few hundred
    that do. A row whose values mostly tie only makes that set larger, never wrong."""
    need = k + banned.size
    sample = row[::TOP_K_SAMPLE_STRIDE]
    if sample.size > need:
        threshold = np.partition(sample, sample.size - need)[sample.size - need]
        ids = np.flatnonzero(row >= threshold)
    else:
        threshold, ids = -np.inf, np.arange(row.size)
    for token in banned:  # a few end tokens; most steps none of them reaches the threshold
        if row[token] >= threshold:
            ids = ids[ids != token]
    if ids.size > k:
        ids = ids[np.argpartition(row[ids], ids.size - k)[ids.size - k:]]
    return ids[np.lexsort((ids, -row[ids]))]


def top_k_rows(logits: np.ndarray, rows: np.ndarray, k: int,
               banned: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The k largest logits of each of `rows` and their token ids, (len(rows), k) each, largest first
    (ties: lower token id first), leaving out each row's `banned` tokens (a line per row, padded with
    -1); k plus the banned tokens a row at most n_vocab // TOP_K_GROUPS. Third, each row's largest
    logit, banned or not (the probability's softmax is over the raw row), which the same pass gives.

    A row's first TOP_K_GROUPS x g tokens (g = n_vocab // TOP_K_GROUPS) are seen as g groups, group j
    holding tokens j, g + j, 2g + j, ...: the largest of each group is one elementwise maximum over the
    row's TOP_K_GROUPS slices. Every one of the k largest tokens lies in one of the k groups with the
    largest maxima (a group holding one of them has a maximum at least that large, and fewer than k
    other groups can beat it), so the exact selection is made among those groups' tokens and the few
    left over at the end of the row: fixed-size arrays for every row of the step at once, no search
    per row. With banned tokens the k + b largest are selected, and the banned ones dropped."""
    n_vocab = logits.shape[1]
    bans = 0 if banned is None else banned.shape[1]
    selected = k + bans
    g = n_vocab // TOP_K_GROUPS
    whole = rows.size == logits.shape[0] and bool(np.all(rows == np.arange(rows.size)))
    source = np.ascontiguousarray(logits if whole else logits[rows])  # no copy of llama.cpp's matrix
    body = source[:, :TOP_K_GROUPS * g].reshape(rows.size, TOP_K_GROUPS, g)
    maxima = body.max(axis=1)
    groups = np.argpartition(maxima, g - selected, axis=1)[:, g - selected:]
    candidates = (groups[:, :, None] + np.arange(TOP_K_GROUPS * g, step=g)[None, None, :]).reshape(rows.size, -1)
    if TOP_K_GROUPS * g < n_vocab:  # the tail that makes no whole group is always a candidate
        tail = np.broadcast_to(np.arange(TOP_K_GROUPS * g, n_vocab), (rows.size, n_vocab - TOP_K_GROUPS * g))
        candidates = np.concatenate([candidates, tail], axis=1)
    flat, starts = source.reshape(-1), (np.arange(rows.size) * n_vocab)[:, None]
    values = flat.take(candidates + starts) + np.float32(0.0)  # one flat take; -0.0 becomes 0.0, its equal
    # Each candidate as one int64 that orders as (logit descending, token ascending): the float's bits
    # made monotonic, negated, above the token id. One partition and a sort of the few selected then
    # give the order that a selection, a gather and a two-key sort would.
    bits = values.view(np.int32)
    keys = ((-(bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64)) << n_vocab.bit_length()) | candidates
    ordered = np.partition(keys, selected - 1, axis=1)[:, :selected]
    ordered.sort(axis=1)
    ids = ordered & ((1 << n_vocab.bit_length()) - 1)
    kept = flat.take(ids + starts)
    tops = kept[:, 0]  # the largest of the row, banned or not: the bans are dropped below
    if banned is not None and bans:  # the first k tokens of each row that are not banned, in order
        allowed = np.argsort((ids[:, :, None] == banned[:, None, :]).any(axis=2), axis=1, kind="stable")[:, :k]
        ids, kept = np.take_along_axis(ids, allowed, axis=1), np.take_along_axis(kept, allowed, axis=1)
    return ids, kept, tops


def _draw_rows(ids: np.ndarray, kept: np.ndarray, requests: Sequence[RequestSampling]) -> list[int]:
    """One draw per row from top-k's survivors (`ids`, their logits `kept`, largest first): top-p, then
    the temperature, then each request's own draw, with the arithmetic of `support` and `_draw`
    on one row. -1 for a row whose smallest survivor is -inf (the caller draws it alone)."""
    top_p = np.array([r.params.top_p for r in requests], dtype=np.float32)[:, None]
    temperature = np.array([r.params.temperature for r in requests], dtype=np.float64)[:, None]
    probs = np.exp(kept - kept[:, :1])
    probs /= probs.sum(axis=1, keepdims=True)
    reached = np.cumsum(probs, axis=1) >= top_p
    cut = np.where(reached.any(axis=1), reached.argmax(axis=1) + 1, kept.shape[1])
    cut[top_p[:, 0] >= 1.0] = kept.shape[1]
    scaled = kept.astype(np.float64) / temperature
    weights = np.exp(scaled - scaled[:, :1])
    weights[np.arange(kept.shape[1])[None, :] >= cut[:, None]] = 0.0
    cumulative = np.cumsum(weights, axis=1)
    totals = cumulative[np.arange(len(requests)), cut - 1]
    finite = np.isfinite(kept[:, -1])
    targets = np.array([r.uniform() if ok else 0.0 for r, ok in zip(requests, finite, strict=True)]) * totals
    picks = np.minimum((cumulative <= targets[:, None]).sum(axis=1), cut - 1)
    tokens = ids[np.arange(len(requests)), picks]
    tokens[~finite] = -1
    return [int(t) for t in tokens]


def _largest(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties: lower token id first)."""
    part = np.arange(row.size) if k >= row.size else np.argpartition(row, row.size - k)[row.size - k:]
    return part[np.lexsort((part, -row[part]))]


def _nucleus(probs: np.ndarray, top_p: float) -> int:
    """How many of the most likely tokens (probabilities sorted, largest first) reach `top_p`; at least
    one. The running sum is float32, as llama.cpp's is."""
    reached = np.flatnonzero(np.cumsum(probs) >= top_p)
    return int(reached[0]) + 1 if reached.size else len(probs)
