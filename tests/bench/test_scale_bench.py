"""scale_bench's process accounting: CPU time and resident memory read from /proc."""

from __future__ import annotations

import os
import resource
import time

from bench import scale_bench


def test_cpu_seconds_of_a_process_grows_with_its_work() -> None:
    before = scale_bench.cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert scale_bench.cpu_seconds(os.getpid()) - before >= 0.1


def test_rss_of_a_process_is_read_in_kib() -> None:
    rss = scale_bench.rss_kib(os.getpid())
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux; updated lazily
    assert peak_kib // 2 < rss < peak_kib * 1.1  # bytes or 4 KiB pages would be far off
