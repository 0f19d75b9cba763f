"""When a step may be cut, and the callback llama.cpp calls between two nodes (C's strlen on the flag)."""

import ctypes

from worker.backends.llama_interrupt import StepInterrupt


def called(interrupt: StepInterrupt) -> bool:
    """What llama.cpp's CPU backend reads when it calls the callback between two nodes."""
    return bool(interrupt._callback(ctypes.cast(interrupt._flag, ctypes.c_void_p)))


def test_only_a_step_carrying_batch_rows_is_cut_and_never_the_one_after_a_cut() -> None:
    interrupt = StepInterrupt()
    interrupt.request()  # between steps: nothing to cut
    assert not interrupt.requested and not called(interrupt)
    interrupt.arm(batch_rows=False)
    interrupt.request()
    assert not called(interrupt)
    interrupt.ended(cut=False)
    interrupt.arm(batch_rows=True)
    interrupt.request()
    assert interrupt.requested and called(interrupt)
    interrupt.ended(cut=True)
    assert not called(interrupt)
    interrupt.arm(batch_rows=True)  # the step after a cut one goes on whatever comes
    interrupt.request()
    assert not called(interrupt)
    interrupt.ended(cut=False)
    interrupt.arm(batch_rows=True)
    interrupt.request()
    assert called(interrupt)
    interrupt.ended(cut=True)
    interrupt.ended(cut=False)
    interrupt.arm(batch_rows=True)  # a flag left over never reaches the next step
    assert not called(interrupt)
