"""Cutting a decode step short for an interactive request: the flag llama.cpp's CPU backend reads between
two nodes of a step's graph (its abort callback), and when a running step may be cut.

Owns: the flag, the callback that reads it, and when a request may set it (while a step that carries a
batch request's rows runs, unless the step before it was cut). Must not: undo anything
(llama.cpp removes the cut ubatch's cells; the engine removes those of the ubatches before it and puts
what the step carried back where it was, worker/backends/llama_engine.py).

Why: on a CPU a step costs about its rows (llama.cpp's kernels below 64 rows, worker/engine/pacing.py),
so an interactive request that came while a step carried a batch job's rows waited that step out, about
three decode steps of its own (docs/benchmarks.md, "A batch on idle capacity"), before its prompt could
go in (with the batch's rows sitting out, llama_engine.py). Cut, the step ends within a graph node; its
work is lost, at most one step's for each interactive request that comes, and the step after a cut one
is never cut, so every sequence goes on at least every other step.

The callback is C's own `strlen` on a two-byte buffer [flag, 0]: llama.cpp calls it as `bool (*)(void *)`
once a node, and strlen answers 0 or 1 in the return register, read as false or true. No Python runs
between nodes: a Python callback would take the GIL at every node (hundreds a step) and wait for the
event loop's thread each time it held it. Only the CPU backend reads the callback (a GPU's graph runs whole).
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as ll


class StepInterrupt:
    def __init__(self) -> None:
        self._flag = (ctypes.c_char * 2)()
        strlen = ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value
        assert strlen is not None
        self._callback = ll.ggml_abort_callback(strlen)  # held: llama.cpp keeps only the pointer
        self._cuttable = False  # the running step may be cut
        self._cut_last = False

    def install(self, ctx: Any) -> None:
        """Makes `ctx`'s steps read the flag (once, before its first step)."""
        ll.llama_set_abort_callback(ctx, self._callback, ctypes.cast(self._flag, ctypes.c_void_p))

    @property
    def requested(self) -> bool:
        return self._flag[0] != b"\0"

    def arm(self, *, batch_rows: bool) -> None:
        """Engine thread, just before every step: one that carries `batch_rows` may be cut, unless the
        step before it was."""
        self._flag[0] = b"\0"
        self._cuttable = batch_rows and not self._cut_last

    def request(self) -> None:
        """Any thread: an interactive request came; cuts the running step if it may be cut."""
        if self._cuttable:
            self._flag[0] = b"\1"

    def ended(self, cut: bool) -> None:
        """Engine thread, after every step (`cut`: llama_decode said it was aborted)."""
        self._cuttable = False
        self._flag[0] = b"\0"
        self._cut_last = cut
