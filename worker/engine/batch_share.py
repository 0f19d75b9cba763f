"""When a batch request's rows may go into a step beside interactive requests' rows.

Owns: the decision, step by step, and the step times it rests on. Must not: touch llama.cpp or a batch
(the engine asks before it fills a step, and reports each step's time after).

Why: on a CPU a step costs about its rows (worker/engine/pacing.py), so six batch rows beside an
interactive stream made each of its tokens take 74-81 ms instead of 18-23 ms (one thread, the default
model; docs/benchmarks.md, "A batch on idle capacity"): a batch job took compute the interactive stream
was using, where it should take only what is left. So, as long as an interactive sequence runs, the batch
rows are paid for in advance: each step without them earns `slowdown - 1` times its own time, a step
with them costs its time less an interactive-only step's, and they join only once that is earned (the
credit capped at one such step, cleared while no interactive sequence runs, so it is never banked). Over
any stretch of interactive decoding its decode-only steps then average at most `slowdown` times their time
alone. A step that also carries a batch prompt's chunk is not counted: charged, it held the batch's prompts
back until several went in together, one long step, and the users fared worse (time per token 1.06-1.53x
against 0.72-1.33x, docs/benchmarks.md, "A batch on idle capacity"). With
no interactive sequence running the batch rows join every step. On a GPU, where a step with a few more
rows costs about the same, they join about every step too.
"""

from __future__ import annotations

ALPHA = 0.2  # weight of each new step time in the running estimates


class BatchShare:
    def __init__(self, slowdown: float) -> None:
        """`slowdown` 0: off (batch rows join every step); 1: never beside interactive ones."""
        self._slowdown = slowdown
        self.alone_s: float | None = None  # a step with interactive rows and no batch rows
        self.with_s: float | None = None  # a step with both
        self.credit = 0.0

    def admits(self, *, interactive: bool) -> bool:
        """Whether the next step may carry batch rows (`interactive`: an interactive sequence runs)."""
        if not interactive or self._slowdown <= 0:
            return True
        if self.alone_s is None:
            return False  # an interactive-only step is the measure: one first
        if self.with_s is None:
            return True  # and one with batch rows
        return self.credit >= self._cost()

    def observe(self, seconds: float, *, interactive: bool, batch: bool, prompt: int = 0) -> None:
        """One step's time, whether it carried interactive rows and batch rows, and its prompt tokens
        (a step with some is not a measure of decoding, and neither earns nor costs)."""
        if self._slowdown <= 0:
            return
        if not interactive:
            self.credit = 0.0
            return
        if prompt:
            return
        if batch:
            self.with_s = _blend(self.with_s, seconds)
            self.credit -= max(0.0, seconds - (self.alone_s if self.alone_s is not None else seconds))
        else:
            self.alone_s = _blend(self.alone_s, seconds)
            self.credit = min(self.credit + (self._slowdown - 1) * seconds, self._cost())

    def _cost(self) -> float:
        """What a step with batch rows costs the interactive rows: its time less one without them."""
        if self.alone_s is None or self.with_s is None:
            return 0.0
        return max(0.0, self.with_s - self.alone_s)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)
