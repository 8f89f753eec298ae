# Helpers for the daemons .ci/slurm-up.sh starts, sourced by it (and by its test).
# They expect a `die MESSAGE` function from the caller.

# A pid file outlives its daemon when a machine is restored from a snapshot or restarted
# without a clean stop, and its number may then belong to another process: a daemon counts
# as running only when that pid is a process of that name.
running() {  # running PIDFILE NAME
    local pid
    [ -f "$1" ] && pid="$(cat "$1" 2>/dev/null)" && [ -n "$pid" ] \
        && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}
stop() {  # stop PIDFILE NAME
    running "$1" "$2" || { rm -f "$1"; return 0; }
    local pid
    pid="$(cat "$1")"
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    die "$2 (pid $pid) did not stop"
}
