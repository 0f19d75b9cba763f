#!/usr/bin/env bash
# What the browser test (tests/integration/test_status_page.py) needs outside Python: Debian's
# Chromium and its matching chromedriver, at /usr/bin/chromium and /usr/bin/chromedriver.
# Idempotent: when both are there it does nothing (no network, well under a second). When one is
# missing and we are root it runs `apt-get update` once and installs both; when we are not root it
# says what to run and exits 0, and the test itself fails with the same message, so a machine
# without a browser is never mistaken for a passing one.
set -euo pipefail

CHROMIUM=/usr/bin/chromium
CHROMEDRIVER=/usr/bin/chromedriver

if [[ -x $CHROMIUM && -x $CHROMEDRIVER ]]; then
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "test-deps: $CHROMIUM or $CHROMEDRIVER is missing and this is not root;" \
         "run: sudo apt-get install -y chromium chromium-driver" >&2
    exit 0
fi

echo "test-deps: installing chromium and chromium-driver (Debian packages) for the browser test" >&2
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp -t test-deps.XXXXXX.log)
if ! { apt-get update && apt-get install -y --no-install-recommends chromium chromium-driver; } >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    echo "test-deps: installing chromium failed (full log: $log)" >&2
    exit 1
fi
rm -f "$log"
echo "test-deps: $("$CHROMIUM" --version 2>/dev/null)" >&2
