#!/bin/bash
# A command that outlives the device call that starts it. The lent machine keeps a call's
# processes while it stays warm (it is given back about 30 s after a call), so a run longer
# than one call's 10 minutes goes on across calls chained back to back: the first starts
# it, each later one waits for it and takes back what it has written so far.
#   bash scripts/detached.sh start DIR CMD [ARGS]  CMD in its own session, from the current
#                                                  directory; its output goes to DIR/log
#   bash scripts/detached.sh wait DIR SECONDS      wait up to SECONDS: exit 0 if it ended
#                                                  well, its own code if it failed, 75
#                                                  while it still runs
#   bash scripts/detached.sh alive DIR             exit 0 while it runs
#   bash scripts/detached.sh stop DIR              stop it and every process of its session
#                                                  (a server started in a session of its own
#                                                  is its starter's to stop on SIGTERM)
set -u
what=${1:?start, wait, alive or stop}; dir=${2:?the directory of the run}
still_running=75

alive() {
  [ -f "$dir/pid" ] && [ ! -f "$dir/rc" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null
}

case "$what" in
  start)
    shift 2
    [ "$#" -gt 0 ] || { echo "detached: no command to start" >&2; exit 2; }
    if alive; then echo "detached: a run in $dir is still going (pid $(cat "$dir/pid"))" >&2; exit 1; fi
    mkdir -p "$dir"; rm -f "$dir/pid" "$dir/rc" "$dir/log"
    # setsid: a session and process group of its own, which `stop` ends as a whole and
    # which the call's own end (or a timeout around the caller) does not reach.
    setsid bash "$0" _run "$dir" "$@" < /dev/null > /dev/null 2>&1 &
    for _ in $(seq 100); do [ -f "$dir/pid" ] && break; sleep 0.05; done
    [ -f "$dir/pid" ] || { echo "detached: the command did not start" >&2; exit 1; }
    echo "detached: started pid $(cat "$dir/pid"), log $dir/log"
    ;;
  _run)  # inside the new session: the pid for alive and stop, the output, the exit code
    shift 2
    echo $$ > "$dir/pid.new" && mv "$dir/pid.new" "$dir/pid"
    "$@" > "$dir/log" 2>&1
    echo $? > "$dir/rc"
    ;;
  wait)
    [ -f "$dir/pid" ] || { echo "detached: no run was started in $dir"; exit 1; }
    deadline=$((SECONDS + ${3:?seconds to wait}))
    while alive && [ "$SECONDS" -lt "$deadline" ]; do sleep 1; done
    if alive; then echo "detached: still running after ${3}s"; exit "$still_running"; fi
    [ -f "$dir/rc" ] || { echo "detached: ended without an exit code (killed?)"; exit 1; }
    rc=$(cat "$dir/rc"); echo "detached: ended, exit code $rc"; exit "$rc"
    ;;
  alive)
    alive
    ;;
  stop)
    alive || { echo "detached: nothing running in $dir"; exit 0; }
    # The whole session (a command may put its children in process groups of their
    # own, as `timeout` does): SIGTERM first, which lets a benchmark stop its servers.
    sid=$(cat "$dir/pid")
    pkill -TERM -s "$sid"
    for _ in $(seq 60); do pgrep -s "$sid" > /dev/null || break; sleep 0.5; done
    pkill -KILL -s "$sid"
    echo "detached: stopped session $sid"
    ;;
  *)
    echo "detached: unknown command $what" >&2; exit 2
    ;;
esac
