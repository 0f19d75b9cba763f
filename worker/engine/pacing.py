"""When an engine step may carry prompt tokens while other sequences are decoding.

Owns: the decision, step by step, and the step times it rests on. Must not: touch llama.cpp or a
batch (the engine asks before it fills a step, and reports each step's time after).

Why: with one prompt chunk in every step, one long prompt made each step on its worker about 1.5 s
(256 tokens on one thread), and a 16-token chat beside it took 8.8-9.1 s instead of 0.49 s (issue 33).
Smaller chunks in every step (Sarathi-Serve's stall-free batching) do not help on a CPU: llama.cpp's
matrix kernels run a batch of fewer than 64 rows at about a third of their speed (measured on this
project's 2-core machine, one thread, 800 tokens of context: 20 ms a row below 64 rows, 5.9 ms at 64
and above; docs/benchmarks.md, "Prefill beside decoding"), so 8 prompt tokens beside a chat cost what
64 do, and a 1,700-token prompt fed 16 at a time took 3.6 times as long.

So prompt tokens go in whole chunks, and the decoding sequences are paid in advance instead: while
anything decodes, a step fills itself with a chunk of a long prompt only once the decode-only steps
before it have earned what that chunk step costs them. Each decode-only step earns `stall - 1` times
its own time; a chunk step costs its time less `stall` decode steps' worth. So over any stretch of
steps with decoding rows they run at least 1/`stall` as fast as alone, a short stream (16 tokens
beside a 64-token chunk of 12 decode steps' time, at 2) may finish before any chunk is due, and no
token waits more than one chunk step (the inter-token bound: D + one chunk step, D a decode-only
step). Credit is capped at one chunk step's cost, and a step with nothing decoding clears it, so it
cannot be banked. A prompt that finishes within the step (a new chat's) goes in whatever the credit,
as it joins the decoding rows; a step with nothing decoding takes a whole chunk, unless such a
prompt is in it (engine: `_add_prompts`).

Joining counts from arrival: sequences that join the decoding rows in a step may have come just as
the step before it began, and waited it out (a chunk step, when a long prompt was in). Alone they
would not have waited, so that step's time is owed to them: the debt is at least it when they join.
Without this, a 16-token chat that came during a chunk step waited up to that step (about 0.45 s on
one thread, 0.75 of its whole time alone), then met a chunk 11 decode steps later: 2.1x of alone
beside two 1,700-token prompts (docs/benchmarks.md, "Prefill beside decoding, from arrival"). With
it, a chat's whole time from arrival, less its own prompt step, is within `stall` x its time alone,
and the chunks go on as fast once it has been paid. The default stall is 1.5 (WORKER_PREFILL_STALL;
it was 2): at 2 a chat that came before a long prompt's first chunk still met one after 11 decode
steps, and the coordinator's and client's share of a busy 2-core machine comes on top of the
engine's; at 1.5 a chunk is due after about 21, past a 16-token chat. Its price: with decoding that
never stops beside it, a long prompt gets about a third of the time beyond the decode steps' (half
at 2).
"""

from __future__ import annotations

ALPHA = 0.2  # weight of each new step time in the running estimates
# Default prompt tokens of a step: on the CPU the least batch that runs at full speed, so a chunk step
# is as short as it can be without costing prefill throughput; on a GPU a wider one, still fast.
CPU_CHUNK = 64
GPU_CHUNK = 256
LONG_STEP = 32  # prompt tokens from which a step's time counts as a chunk step's


class PrefillPace:
    def __init__(self, *, stall: float) -> None:
        """`stall` <= 1: off, every step carries a chunk (the behaviour before)."""
        self._stall = stall
        self.decode_s: float | None = None  # D: a decode-only step, exponentially weighted
        self.chunk_s: float | None = None  # a step that carries a chunk
        self.debt = 0.0  # seconds the decoding sequences are owed (negative: credit)
        self._last_s = 0.0  # the step before: what a sequence joining now may have waited

    def admits(self, decoding: int) -> bool:
        """Whether the next step, with `decoding` rows that decode (or finish their prompt in it), may
        fill itself with a chunk of a longer prompt."""
        if decoding == 0 or self._stall <= 1:
            return True
        if self.decode_s is None:
            return False  # a decode-only step is the measure: one first
        return self.debt + self._cost() <= 0

    def idle(self) -> None:
        """The engine waits with nothing to do: whoever comes now waits out no step."""
        self._last_s = 0.0

    def observe(self, decoding: int, prompt: int, seconds: float, *, joining: int = 0) -> None:
        """One step's time, with its decoding rows, its prompt tokens and the sequences whose prompt
        it finished (they decode from the next step)."""
        if self._stall <= 1:
            return
        held, self._last_s = self._last_s, seconds
        if prompt >= LONG_STEP:
            self.chunk_s = _blend(self.chunk_s, seconds)
        if not decoding:
            self.debt = 0.0  # nobody was held; and nobody banks credit through a pause
        elif prompt:
            self.debt += seconds - self._stall * (self.decode_s if self.decode_s is not None else seconds)
        else:
            self.decode_s = _blend(self.decode_s, seconds)
            self.debt = max(self.debt - (self._stall - 1) * seconds, -self._cost())  # credit for one chunk, no more
        if joining:
            self.debt = max(self.debt, held)  # they may have waited out the step before: owed from arrival

    def _cost(self) -> float:
        """What the decoding sequences are owed for one chunk step: its time less `stall` decode steps."""
        if self.chunk_s is None or self.decode_s is None:
            return 0.0
        return max(0.0, self.chunk_s - self._stall * self.decode_s)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)
