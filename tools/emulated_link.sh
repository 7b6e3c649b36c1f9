#!/usr/bin/env bash
# Run a command over an emulated, bandwidth-limited network link on this one machine.
#
#   tools/emulated_link.sh mpiexec -n 2 python -m mpiopt.bench.averaging
#   RATE=100mbit tools/emulated_link.sh mpiexec -n 4 python my_script.py
#
# How: the command runs in a fresh network namespace (`unshare -n`, needs root)
# whose loopback device gets a token-bucket filter (`tc qdisc ... tbf`), and
# MPICH is told to send over TCP on that loopback instead of shared memory.
# Every byte between ranks, in both directions, passes the one shaped device:
# at RATE=1gbit two ranks share 125 MB/s.
#
# Environment:
#   RATE     link rate in tc's units (default 1gbit; e.g. 100mbit, 10gbit)
#   BURST    token bucket size (default 1mb)
#   LATENCY  longest time a packet may wait in the bucket (default 10ms)
set -euo pipefail

die() { echo "emulated_link.sh: $*" >&2; exit 2; }

[[ $# -ge 1 ]] || die "usage: [RATE=1gbit] $0 COMMAND [ARGS...]  (e.g. $0 mpiexec -n 2 python -m mpiopt.bench.averaging)"
[[ $(id -u) -eq 0 ]] || die "needs root: unshare -n (a new network namespace) and tc need CAP_SYS_ADMIN/CAP_NET_ADMIN; run as root (e.g. with sudo -E)"
for tool in unshare ip tc; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found: install util-linux (unshare) and iproute2 (ip, tc)"
done

RATE="${RATE:-1gbit}" BURST="${BURST:-1mb}" LATENCY="${LATENCY:-10ms}"

# Why each variable:
#   MPIR_CVAR_NOLOCAL=1        no shared memory between ranks of one node: all traffic goes to the netmod
#   MPIR_CVAR_CH4_NETMOD=ofi   libfabric netmod (the PyPI MPICH also has UCX, which would pick shared memory)
#   FI_PROVIDER=tcp            libfabric's TCP sockets provider...
#   FI_TCP_IFACE=lo            ...on the (shaped) loopback device
export MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=lo
export EMULATED_LINK_RATE="$RATE"

unshare -n true 2>/dev/null ||
    die "unshare -n failed: creating a network namespace needs CAP_SYS_ADMIN (a container may forbid it even to root)"

# The setup runs inside the namespace; "$@" is passed through untouched.
export RATE BURST LATENCY
exec unshare -n -- bash -c '
    ip link set lo up || { echo "emulated_link.sh: cannot bring up lo in the new namespace" >&2; exit 2; }
    tc qdisc add dev lo root tbf rate "$RATE" burst "$BURST" latency "$LATENCY" ||
        { echo "emulated_link.sh: tc could not shape lo (RATE=$RATE BURST=$BURST LATENCY=$LATENCY); is sch_tbf available?" >&2; exit 2; }
    exec "$@"
' emulated_link "$@"
