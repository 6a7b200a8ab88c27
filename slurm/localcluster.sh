#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for testing the rlfleet launcher.
#
#   slurm/localcluster.sh up [--nodes N] [--cpus C] [--netns]   start munged, slurmctld, N slurmd
#   slurm/localcluster.sh env                                   print `export SLURM_CONF=...`
#   slurm/localcluster.sh status                                sinfo + daemon PIDs
#   slurm/localcluster.sh restart-node NAME                     start a killed node's slurmd again
#   slurm/localcluster.sh down                                  cancel jobs, stop what `up` started
#
# Everything lives under one scratch folder, $RLFLEET_SLURM_DIR (default
# /tmp/rlfleet-slurm): slurm.conf, the munge key and socket, spool and state folders,
# daemon logs and PID files. /etc/slurm, /etc/munge and /run/munge are never touched;
# clients find the cluster through SLURM_CONF, which jobs inherit.
#
# Guarantees:
# - `up` installs Debian's slurmctld, slurmd, slurm-client and munge (and iproute2
#   for --netns) when they are missing; it must run as root. It returns once every
#   node is idle, or fails (non-zero, daemon logs printed) and tears down what it began.
# - `down` is idempotent. It stops only processes whose PIDs `up` recorded (each PID
#   is checked against the program it should be running, so a recycled PID is left
#   alone), and deletes only the network namespaces and bridge `up` recorded.
# - With --netns each emulated node gets its own network namespace and IP address
#   (10.213.0.11, .12, ...) behind a bridge at 10.213.0.1, so Ray sees distinct hosts.
# - `restart-node NAME` brings back a node whose processes were killed (a node-loss test):
#   it starts that node's slurmd again (in its namespace with --netns), records its PID,
#   resumes the node if it is DOWN (set by hand, or by slurmctld after SlurmdTimeout), and
#   returns once the node is up.
set -euo pipefail

S=${RLFLEET_SLURM_DIR:-/tmp/rlfleet-slurm}
CTLD_PORT=${RLFLEET_SLURMCTLD_PORT:-6917}      # slurmd ports follow: 6918, 6919, ...
FIRST_JOB_ID=${RLFLEET_SLURM_FIRST_JOB_ID:-1}  # distinct per cluster when two run on one machine
NET_PREFIX=${RLFLEET_NETNS_PREFIX:-10.213.0}
BRIDGE=${RLFLEET_NETNS_BRIDGE:-rlfbr0}

log() { printf '[localcluster] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

need_root() { [[ $(id -u) -eq 0 ]] || die "must run as root (slurmd, munge and namespaces need it)"; }

ensure_packages() {
    local want=() netns=$1
    command -v slurmctld >/dev/null || want+=(slurmctld)
    command -v slurmd >/dev/null || want+=(slurmd)
    command -v sbatch >/dev/null || want+=(slurm-client)
    command -v munged >/dev/null || want+=(munge)
    if [[ $netns == 1 ]]; then
        command -v ip >/dev/null || want+=(iproute2)
        command -v nsenter >/dev/null || want+=(util-linux)
    fi
    command -v setsid >/dev/null || want+=(util-linux)
    ((${#want[@]} == 0)) && return 0
    log "installing ${want[*]} (apt-get, --no-install-recommends)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
}

# -- PID bookkeeping: record what we start, kill only that -------------------------
record() { echo "$2 $3" >"$S/pids/$1"; }   # name pid expected-program

pid_matches() {   # pid program: true if /proc/pid runs that program
    local pid=$1 prog=$2 exe
    [[ -d /proc/$pid ]] || return 1
    exe=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    [[ $exe == *"$prog"* && $exe == *"$S"* ]]
}

stop_recorded() {
    local f pid prog
    [[ -d $S/pids ]] || return 0
    for f in "$S"/pids/*; do
        [[ -e $f ]] || continue
        read -r pid prog <"$f"
        if pid_matches "$pid" "$prog"; then kill -TERM "$pid" 2>/dev/null || true; fi
    done
    local deadline=$((SECONDS + 10))
    for f in "$S"/pids/*; do
        [[ -e $f ]] || continue
        read -r pid prog <"$f"
        while pid_matches "$pid" "$prog" && ((SECONDS < deadline)); do sleep 0.1; done
        if pid_matches "$pid" "$prog"; then
            log "$(basename "$f") (pid $pid) ignored TERM; killing"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$f"
    done
}

# -- configuration ------------------------------------------------------------------
write_conf() {   # nodes cpus netns
    local n=$1 cpus=$2 netns=$3 host ctld_addr i addr
    host=$(hostname -s)
    ctld_addr=127.0.0.1
    [[ $netns == 1 ]] && ctld_addr=$NET_PREFIX.1
    cat >"$S/slurm.conf" <<EOF
# Written by slurm/localcluster.sh; the whole cluster lives under $S.
ClusterName=rlfleetci
SlurmctldHost=$host($ctld_addr)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$S/munge/munge.socket.2
StateSaveLocation=$S/state
SlurmdSpoolDir=$S/spool/%n
SlurmctldPidFile=$S/run/slurmctld.pid
SlurmdPidFile=$S/run/slurmd-%n.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
MinJobAge=4
FirstJobId=$FIRST_JOB_ID
KillWait=30
InactiveLimit=0
SchedulerType=sched/backfill
EOF
    for ((i = 1; i <= n; i++)); do
        addr=127.0.0.1
        [[ $netns == 1 ]] && addr=$NET_PREFIX.$((10 + i))
        echo "NodeName=n$i NodeAddr=$addr NodeHostname=$host Port=$((CTLD_PORT + i)) CPUs=$cpus State=UNKNOWN" >>"$S/slurm.conf"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$S/slurm.conf"
}

# -- network namespaces (one per node, behind one bridge) ---------------------------
netns_up() {
    local n=$1 i ns
    ip link add "$BRIDGE" type bridge
    echo "bridge $BRIDGE" >>"$S/net"
    ip addr add "$NET_PREFIX.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for ((i = 1; i <= n; i++)); do
        ns=rlf-n$i
        ip netns add "$ns"
        echo "netns $ns" >>"$S/net"
        ip link add "rlfv$i" type veth peer name eth0 netns "$ns"
        ip link set "rlfv$i" master "$BRIDGE" up
        ip -n "$ns" addr add "$NET_PREFIX.$((10 + i))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" route add default via "$NET_PREFIX.1"   # Ray needs a route to find its IP
    done
}

netns_down() {
    [[ -f $S/net ]] || return 0
    local kind name
    while read -r kind name; do
        case $kind in
            netns) ip netns del "$name" 2>/dev/null || true ;;   # its veth end goes with it
            bridge) ip link del "$name" 2>/dev/null || true ;;
        esac
    done < <(tac "$S/net")
    rm -f "$S/net"
}

# -- daemons ------------------------------------------------------------------------
start_munge() {
    mkdir -p "$S/munge"
    chown munge:munge "$S/munge"
    chmod 0755 "$S/munge"   # munged requires execute permission for all on its socket dir
    if [[ ! -f $S/munge/munge.key ]]; then
        if command -v mungekey >/dev/null; then
            mungekey -c -f -k "$S/munge/munge.key"
        else
            dd if=/dev/urandom bs=1 count=1024 of="$S/munge/munge.key" 2>/dev/null
        fi
    fi
    chown munge:munge "$S/munge/munge.key"
    chmod 0400 "$S/munge/munge.key"
    setsid runuser -u munge -- munged -F --socket="$S/munge/munge.socket.2" \
        --key-file="$S/munge/munge.key" --pid-file="$S/munge/munged.pid" \
        --log-file="$S/munge/munged.log" --seed-file="$S/munge/munged.seed" \
        </dev/null >>"$S/log/munged.out" 2>&1 &
    local pid=$!
    # runuser forks munged; record munged itself once its pid file appears.
    local deadline=$((SECONDS + 10))
    until [[ -S $S/munge/munge.socket.2 && -s $S/munge/munged.pid ]]; do
        ((SECONDS < deadline)) || die "munged did not create its socket; see $S/munge/munged.log"
        kill -0 "$pid" 2>/dev/null || die "munged exited; see $S/munge/munged.log"
        sleep 0.05
    done
    record munged "$(cat "$S/munge/munged.pid")" munged
}

start_slurmd() {   # node: start its slurmd (in its network namespace if `up` made one) and record it
    local node=$1 pre=()
    mkdir -p "$S/spool/$node"
    # nsenter, not `ip netns exec`: the latter remounts /sys and slurmd then finds no cgroup fs.
    [[ -f $S/net ]] && grep -qx "netns rlf-$node" "$S/net" && pre=(nsenter "--net=/run/netns/rlf-$node")
    setsid "${pre[@]}" slurmd -D -f "$S/slurm.conf" -N "$node" </dev/null >>"$S/log/slurmd-$node.out" 2>&1 &
    record "slurmd-$node" $! slurmd
}

start_slurm() {   # nodes
    local n=$1 i
    setsid slurmctld -D -c -f "$S/slurm.conf" </dev/null >>"$S/log/slurmctld.out" 2>&1 &
    record slurmctld $! slurmctld
    for ((i = 1; i <= n; i++)); do start_slurmd "n$i"; done
}

wait_idle() {   # nodes
    local n=$1 deadline=$((SECONDS + 60)) idle
    while ((SECONDS < deadline)); do
        idle=$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l || true)
        ((idle == n)) && return 0
        sleep 0.2
    done
    sinfo -N -l >&2 || true
    tail -n 20 "$S"/log/*.log >&2 || true
    return 1
}

cmd_up() {
    local nodes=2 cpus=8 netns=0
    while (($#)); do
        case $1 in
            --nodes) nodes=$2; shift 2 ;;
            --cpus) cpus=$2; shift 2 ;;
            --netns) netns=1; shift ;;
            *) die "unknown option $1" ;;
        esac
    done
    need_root
    ensure_packages "$netns"
    if [[ -d $S/pids ]] && compgen -G "$S/pids/*" >/dev/null; then
        die "a cluster is already up under $S (run: $0 down)"
    fi
    rm -rf "$S/state" "$S/spool" "$S/log" "$S/run"
    mkdir -p "$S/pids" "$S/state" "$S/spool" "$S/log" "$S/run"
    export SLURM_CONF=$S/slurm.conf
    trap 'rc=$?; if ((rc != 0)); then log "bring-up failed; tearing down"; tail -n 5 "$S"/log/* "$S"/munge/*.log 2>/dev/null >&2; cmd_down; fi' EXIT
    write_conf "$nodes" "$cpus" "$netns"
    [[ $netns == 1 ]] && netns_up "$nodes"
    start_munge
    start_slurm "$nodes"
    wait_idle "$nodes" || { log "nodes never became idle"; false; }
    trap - EXIT
    log "up: $nodes node(s), $cpus CPUs each$([[ $netns == 1 ]] && echo ", one network namespace per node"); SLURM_CONF=$SLURM_CONF"
}

cmd_down() {
    export SLURM_CONF=$S/slurm.conf
    if [[ -f $SLURM_CONF ]] && pid_matches "$(awk '{print $1}' "$S/pids/slurmctld" 2>/dev/null || echo 0)" slurmctld; then
        # Cancel jobs first so their launchers stop their Ray processes (they trap the signal).
        local jobs deadline=$((SECONDS + 40))
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            log "cancelling jobs: $(echo $jobs)"
            scancel $jobs 2>/dev/null || true
            while [[ -n $(squeue -h -o %i 2>/dev/null || true) ]] && ((SECONDS < deadline)); do sleep 0.2; done
        fi
    fi
    stop_recorded
    netns_down
    log "down ($S)"
}

node_state() { sinfo -h -N -n "$1" -o '%T' 2>/dev/null | head -n 1; }   # e.g. idle, down*, allocated*

cmd_restart_node() {   # node
    local node=${1:-} pid prog state deadline resumed=0
    [[ -n $node ]] || die "usage: $0 restart-node NAME"
    need_root
    export SLURM_CONF=$S/slurm.conf
    [[ -f $SLURM_CONF ]] && grep -q "^NodeName=$node " "$SLURM_CONF" || die "no node $node in a cluster under $S"
    if [[ -f $S/pids/slurmd-$node ]]; then
        read -r pid prog <"$S/pids/slurmd-$node"
        pid_matches "$pid" "$prog" && die "slurmd of $node is still running (pid $pid)"
    fi
    start_slurmd "$node"
    deadline=$((SECONDS + 60))
    while ((SECONDS < deadline)); do
        state=$(node_state "$node")
        case $state in
            '' | *'*' | unknown*) ;;   # its slurmd has not registered yet
            down* | drain* | fail*)    # registered, but DOWN by hand or after SlurmdTimeout: resume it
                ((resumed)) || scontrol update "NodeName=$node" State=RESUME || true   # it may return on its own meanwhile
                resumed=1
                ;;
            *) log "$node is back ($state)"; return 0 ;;
        esac
        sleep 0.2
    done
    sinfo -N -l >&2 || true
    die "$node did not come back within 60 s (state: $(node_state "$node"))"
}

cmd_status() {
    export SLURM_CONF=$S/slurm.conf
    local f pid prog
    for f in "$S"/pids/*; do
        [[ -e $f ]] || { echo "no cluster under $S"; return 0; }
        read -r pid prog <"$f"
        printf '%-12s pid %-8s %s\n' "$(basename "$f")" "$pid" "$(pid_matches "$pid" "$prog" && echo running || echo gone)"
    done
    sinfo -N -l || true
}

case ${1:-} in
    up) shift; cmd_up "$@" ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$S/slurm.conf" ;;
    restart-node) shift; cmd_restart_node "$@" ;;
    *) echo "usage: $0 {up [--nodes N] [--cpus C] [--netns] | restart-node NAME | down | status | env}" >&2; exit 2 ;;
esac
