"""The operator's live status page: `GET /status` (and `GET /`, which redirects to it), and
`GET /coordinator/status`, the JSON snapshot the page polls every second.

Owns: serving `static/status.html` (one self-contained page: inline CSS and JS, no external asset,
no build step) under a Content-Security-Policy that lets only its own inline script run, and the
snapshot: coordinator/ops/health.py's two listings plus the coordinator's cumulative counters, read from
its metrics (admission outcomes, stream endings, tokens, TTFT and latency sums).
Must not: count or keep anything itself. The page turns the counters into per-second rates from
consecutive snapshots, so the coordinator keeps no history for it and does no work per request for
it; a snapshot costs one pass over the workers (the listing's) and one over each counter's label
sets, whose number is bounded by the reason strings, not by the requests served.

With client API keys configured the snapshot needs one like /metrics does (coordinator/app.py's
`_let_in` decides; unless `open_metrics`), while the page stays open: it holds no data. On a 401 the
page asks for a key, keeps it in the tab's sessionStorage and sends it as `X-API-Key`; a link may
carry it as `status#key=<key>` (a fragment never reaches the server, and the page removes it).
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, Field

from coordinator.metrics import tenant_label
from coordinator.ops import health
from coordinator.state import CoordinatorState
from protocol.coordinator import CoordinatorHealth, WorkerStatusList

PAGE_PATH = "/status"
SNAPSHOT_PATH = "/coordinator/status"
PAGE_FILE = Path(__file__).parent / "static" / "status.html"

router = APIRouter()


class TenantUsage(BaseModel):
    """One tenant's totals (coordinator/metrics.py's per-tenant counters)."""

    prompt_tokens: int = Field(ge=0, description="prompt tokens of its requests that workers admitted")
    generated_tokens: int = Field(ge=0, description="tokens generated for it, as relayed")
    queue_waits: int = Field(ge=0, description="its requests that waited in the admission queue")
    refused: dict[str, int] = Field(description="its requests refused before their first byte, by reason")
    counter: float = Field(default=0.0, ge=0.0, description="its fair-share counter: weighted tokens the pool "
                           "served it (every coordinator's requests), divided by its weight; the lowest goes next")


class Counters(BaseModel):
    """Totals since the coordinator started; the page takes differences between two snapshots."""

    admitted: int = Field(ge=0, description="requests admitted")
    rejected: dict[str, int] = Field(description="requests refused before their first byte, by reason")
    queue_outcomes: dict[str, int] = Field(description="waits in the admission queue ended, by outcome")
    queue_length: int = Field(ge=0, description="requests waiting in the admission queue now")
    finished: dict[str, int] = Field(description="admitted streams ended, by finish reason")
    failovers: int = Field(ge=0, description="workers given up on before a first token")
    session_moves: dict[str, int] = Field(default_factory=dict, description="draining workers' kept sessions "
                                          "moved to another worker (`moved`) or not, by outcome")
    generation_tokens: int = Field(ge=0, description="token events relayed (counted when a stream ends)")
    ttft_count: int = Field(ge=0, description="streams that sent a first token")
    ttft_sum_s: float = Field(ge=0.0, description="their times to first token, summed")
    e2e_count: int = Field(ge=0, description="streams ended")
    e2e_sum_s: float = Field(ge=0.0, description="their durations, summed")
    tenants: dict[str, TenantUsage] = Field(default_factory=dict, description="per tenant (`t:NAME`, `k:` and a "
                                            "key's hash, or `default` without keys): what fair shares count")


class StatusSnapshot(BaseModel):
    """`GET /coordinator/status`: everything the status page shows, taken at one instant."""

    now_s: float = Field(description="the coordinator's monotonic clock, seconds: rates divide by its differences")
    heartbeat_interval_s: float
    stale_after_s: float = Field(description="a worker this long without a heartbeat is stale (not scheduled)")
    dead_after_s: float = Field(description="a worker this long without a heartbeat is removed")
    health: CoordinatorHealth
    workers: WorkerStatusList
    counters: Counters


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    # Relative, so the page also works behind a proxy that mounts the coordinator under a prefix.
    return RedirectResponse(PAGE_PATH.lstrip("/"), status_code=307)


@router.get(PAGE_PATH, include_in_schema=False)
async def page() -> HTMLResponse:
    html, script_hash = _page()
    return HTMLResponse(html, headers={
        # Only the page's own inline script runs and it reaches only this origin: data a heartbeat
        # carried could not load or run anything even if the page ever inserted it as markup.
        "content-security-policy": (f"default-src 'none'; script-src '{script_hash}'; style-src 'unsafe-inline'; "
                                    "connect-src 'self'; base-uri 'none'; "
                                    "form-action 'none'; frame-ancestors 'none'"),
        "x-content-type-options": "nosniff",
        "cache-control": "no-cache",
    })


@router.get(SNAPSHOT_PATH)
async def snapshot(request: Request) -> StatusSnapshot:
    state: CoordinatorState = request.app.state.coordinator
    settings = state.settings
    # The listings sweep the registry first, so state and counts agree with the health endpoints.
    return StatusSnapshot(
        now_s=state.clock.monotonic(), heartbeat_interval_s=settings.heartbeat_interval,
        stale_after_s=settings.stale_after, dead_after_s=settings.dead_after,
        health=await health.health(request), workers=await health.workers(request),
        counters=counters(state))


def counters(state: CoordinatorState) -> Counters:
    m = state.metrics
    admission = _by_label(m.admission, "outcome")
    ttft_count, ttft_sum = _count_and_sum(m.ttft)
    e2e_count, e2e_sum = _count_and_sum(m.e2e)
    return Counters(
        admitted=int(admission.get("admitted", 0)),
        rejected={k: int(v) for k, v in _by_label(m.admission, "reason", outcome="rejected").items()},
        queue_outcomes={k: int(v) for k, v in _by_label(m.queue_outcomes, "outcome").items()},
        queue_length=state.queue.length,
        finished={k: int(v) for k, v in _by_label(m.finished, "finish_reason").items()},
        failovers=int(sum(_by_label(m.failovers, "reason").values())),
        session_moves={k: int(v) for k, v in _by_label(m.session_moves, "outcome").items()},
        generation_tokens=int(_total(m.generation_tokens)),
        ttft_count=ttft_count, ttft_sum_s=ttft_sum, e2e_count=e2e_count, e2e_sum_s=e2e_sum,
        tenants=tenants(state))


def tenants(state: CoordinatorState) -> dict[str, TenantUsage]:
    """Each tenant's usage here and its fair-share counter: one pass over the per-tenant counters'
    label sets (one per configured tenant and kind or reason, never per request)."""
    m = state.metrics
    prompt = _by_label(m.tenant_tokens, "tenant", kind="prompt")
    generated = _by_label(m.tenant_tokens, "tenant", kind="generated")
    waits: dict[str, int] = {}
    for metric in m.tenant_queue_wait.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                waits[sample.labels["tenant"]] = int(sample.value)
    refused: dict[str, dict[str, int]] = {}
    for metric in m.tenant_refusals.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                refused.setdefault(sample.labels["tenant"], {})[sample.labels["reason"]] = int(sample.value)
    counters = {tenant_label(tenant): value for tenant, value in state.fair.counters().items()}
    names = set(prompt) | set(generated) | set(waits) | set(refused) | set(counters)
    return {name: TenantUsage(prompt_tokens=int(prompt.get(name, 0)), generated_tokens=int(generated.get(name, 0)),
                              queue_waits=waits.get(name, 0), refused=refused.get(name, {}),
                              counter=round(counters.get(name, 0.0), 3))
            for name in sorted(names)}


def _by_label(counter: Counter, label: str, **where: str) -> dict[str, float]:
    """The counter's `_total` samples summed by one label, over the label sets matching `where`."""
    out: dict[str, float] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in where.items()):
                key = sample.labels[label]
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _total(counter: Counter) -> float:
    return sum(s.value for metric in counter.collect() for s in metric.samples if s.name.endswith("_total"))


def _count_and_sum(histogram: Histogram) -> tuple[int, float]:
    count, total = 0, 0.0
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                count += int(sample.value)
            elif sample.name.endswith("_sum"):
                total += sample.value
    return count, total


@cache
def _page() -> tuple[str, str]:
    """The page and the CSP source of its one inline script (read once: the file ships with the code)."""
    html = PAGE_FILE.read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.DOTALL)
    if len(scripts) != 1:
        raise RuntimeError(f"{PAGE_FILE} must hold exactly one inline <script>, found {len(scripts)}")
    digest = hashlib.sha256(scripts[0].encode("utf-8")).digest()
    return html, "sha256-" + base64.b64encode(digest).decode("ascii")
