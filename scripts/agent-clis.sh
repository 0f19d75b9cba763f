#!/usr/bin/env bash
# The coding agents the agents' APIs are checked with (issue 49): Claude Code and Codex CLI, the npm
# packages their users install, pinned, in .agents/ (git-ignored): .agents/node_modules/.bin/claude and
# .agents/node_modules/.bin/codex. Idempotent: when the pinned versions are there it does nothing (no
# network, well under a second). Node.js comes from Debian's packages when it is missing and we are root;
# otherwise it says what to run and exits 0, and the tests that need an agent fail with the same message.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CLAUDE_CODE="@anthropic-ai/claude-code@2.1.332"
CODEX="@openai/codex@0.171.0"
dir=.agents
stamp="$dir/.stamp"
want="$CLAUDE_CODE $CODEX"

if [[ -f $stamp && $(cat "$stamp") == "$want" && -x $dir/node_modules/.bin/claude && -x $dir/node_modules/.bin/codex ]]; then
    exit 0
fi
if ! command -v npm > /dev/null; then
    if [[ $(id -u) -ne 0 ]]; then
        echo "agent-clis: npm is missing and this is not root; run: sudo apt-get install -y nodejs npm" >&2
        exit 0
    fi
    echo "agent-clis: installing nodejs and npm (Debian packages)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update > /dev/null && apt-get install -y --no-install-recommends nodejs npm > /dev/null
fi
echo "agent-clis: installing $want into $dir/" >&2
mkdir -p "$dir"
log=$(mktemp -t agent-clis.XXXXXX.log)
if ! npm install --prefix "$dir" --no-audit --no-fund --no-save "$CLAUDE_CODE" "$CODEX" > "$log" 2>&1; then
    tail -n 20 "$log" >&2
    echo "agent-clis: npm install failed (full log: $log)" >&2
    exit 1
fi
rm -f "$log"
echo "$want" > "$stamp"
