#!/bin/sh
# Make an unmodified agent replay-safe with nothing but environment variables.
#
#   only_env.sh COMMAND [ARGS...]
#
# Points the agent's OPENAI_BASE_URL (and its own TOOLS_URL) at the proxy's run-scoped
# URL, $IDEM_PROXY_URL/runs/$IDEM_RUN_ID/epochs/$EPOCH/cap/$TOKEN, runs it, and marks the run
# completed when it exits 0. Any other exit leaves the run running: a crash, and the
# supervisor starts the run again after its timeout. The completion carries the epoch
# (Idem-Epoch), so an attempt that was superseded meanwhile cannot end the run.
#
# As the supervisor's hook (examples/config.toml) it is handed IDEM_RUN_BASE:
#   command = ["sh", "examples/only_env.sh", "python", "examples/plain_agent.py"]
# Started by anything else, name the run and it asks the proxy for an attempt:
#   IDEM_RUN_ID=plain-1 sh examples/only_env.sh python examples/plain_agent.py
#
# Needs curl and sed. The agent needs its usual OPENAI_API_KEY; with the run's token in its
# base URL, every attempt's calls are the run's whatever credential they carry.
set -eu

: "${IDEM_PROXY_URL:=http://127.0.0.1:8787}"
: "${IDEM_RUN_ID:?set IDEM_RUN_ID to the run this agent works in}"

if [ -z "${IDEM_RUN_BASE:-}" ]; then
    # Epoch 0 for a new run; for an existing one a new attempt, which fences any earlier
    # process of the run that is still alive (its calls get 412).
    answer=$(curl -fsS -X POST "$IDEM_PROXY_URL/runs/$IDEM_RUN_ID/attempts")
    IDEM_RUN_BASE=$(printf '%s\n' "$answer" | sed -n 's/.*"base_url":"\([^"]*\)".*/\1/p')
    [ -n "$IDEM_RUN_BASE" ] || { echo "only_env.sh: no attempt: $answer" >&2; exit 1; }
fi
# the base URL is .../runs/$RUN/epochs/$EPOCH/cap/$TOKEN (the run's token: its calls are the run's)
case $IDEM_RUN_BASE in
    */cap/*) token=${IDEM_RUN_BASE##*/cap/} ;;
    *) token= ;;  # a proxy that gives no token
esac
epoch=${IDEM_RUN_BASE%/cap/*}
epoch=${epoch##*/epochs/}
echo "only_env.sh: run $IDEM_RUN_ID at $IDEM_RUN_BASE" >&2

OPENAI_BASE_URL="$IDEM_RUN_BASE/openai/v1" TOOLS_URL="$IDEM_RUN_BASE/tools" "$@" || exit $?

status=$(curl -sS -o /dev/null -w '%{http_code}' -X POST -H "Idem-Epoch: $epoch" \
    ${token:+-H "Idem-Run-Token: $token"} "$IDEM_PROXY_URL/runs/$IDEM_RUN_ID/complete") || true
case $status in
    200) echo "only_env.sh: run $IDEM_RUN_ID completed" >&2 ;;
    412) echo "only_env.sh: epoch $epoch was superseded by a newer attempt; the run is not ours to end" >&2
         exit 1 ;;
    *) echo "only_env.sh: completing run $IDEM_RUN_ID answered $status" >&2; exit 1 ;;
esac
