"""Admission: whether the pool has room for a request now (`capacity`: the O(1) check against every
alive worker's sums, and the reservations made per worker), what a request needs (`demand`), and the
bounded per-model queue a request waits in while capacity is short (`queue`)."""
