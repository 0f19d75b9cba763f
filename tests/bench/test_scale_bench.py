"""scale_bench's process accounting: CPU time and resident memory read from /proc."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

from bench import scale_bench


def test_cpu_seconds_of_a_process_grows_with_its_work() -> None:
    before = scale_bench.cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert scale_bench.cpu_seconds(os.getpid()) - before >= 0.1


def test_rss_of_a_process_is_read_in_kib() -> None:
    rss = scale_bench.rss_kib(os.getpid())
    # statm counts resident pages: in KiB that is pages x the page size / 1024 (bytes or pages would be
    # off by 1,024 or 4x). Not the peak from getrusage: after a test freed a model, the RSS is far below it.
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    assert abs(rss - pages * resource.getpagesize() // 1024) < 0.1 * rss
