#!/usr/bin/env bash
# An emulated multi-node cluster on this one machine: N network namespaces ("nodes"), each with its own
# hostname, joined through a bridge by shaped links; MPICH's mpiexec inside reaches them without ssh.
#
#   tools/emulated_cluster.sh --nodes 2 --ranks-per-node 2 --rate 1gbit --delay 1ms -- \
#       mpiexec -n 4 python -m mpiopt train ...
#
# See --help and docs/emulated-cluster.md.  Needs root (ip netns, tc, unshare, nsenter).
set -euo pipefail

PROG=emulated_cluster.sh
die() { echo "$PROG: $*" >&2; exit 2; }

usage() {
    cat <<'EOF'
usage: tools/emulated_cluster.sh [--nodes N] [--ranks-per-node K] [--rate RATE] [--delay DELAY] [--loss LOSS]
                                 -- COMMAND [ARGS...]

Builds N emulated nodes on this machine and runs COMMAND on the first of them (node0), like a user logged
into a cluster's first node.  Inside COMMAND a plain `mpiexec -n P PROGRAM` starts K ranks per node,
node0 first, over all N nodes: the script exports HYDRA_HOST_FILE (node0:K, node1:K, ...),
HYDRA_LAUNCHER=ssh and HYDRA_LAUNCHER_EXEC (a helper that enters the node's namespaces instead of ssh) for
MPICH's mpiexec, and the same nodes and helper for Open MPI 5's (PRTE_MCA_prte_default_hostfile,
PRTE_MCA_plm_ssh_agent; its TCP transport and daemons on eth0).
Example:

  tools/emulated_cluster.sh --nodes 2 --ranks-per-node 2 --rate 1gbit --delay 1ms -- \
      mpiexec -n 4 python -m mpiopt train --algorithm sgd --steps 2

Each node is a network namespace with its own hostname (node0, node1, ...; UTS namespace per process) and
address 10.77.0.(i+1)/24 on a device named eth0, and /etc/hosts naming all nodes (ip netns's
/etc/netns/NAME/hosts, seen only inside).  Ranks of one node use shared memory; ranks of different nodes
use TCP (MPICH ch4:ofi, libfabric tcp on eth0; torch gloo on eth0 too).

Options:
  --nodes N            number of nodes (default 2)
  --ranks-per-node K   ranks per node in the host file (default 2)
  --rate RATE          each node's link rate, both directions, in tc units (default 1gbit)
  --delay DELAY        one-way delay between two nodes, in tc units (default 0ms; needs sch_netem)
  --loss LOSS          packet loss on each node's outgoing link, e.g. 0.1% (default none; needs sch_netem)
  -h, --help           this text

Environment set for COMMAND: HYDRA_HOST_FILE, HYDRA_LAUNCHER, HYDRA_LAUNCHER_EXEC,
MPIR_CVAR_CH4_NETMOD=ofi, FI_PROVIDER=tcp, FI_TCP_IFACE=eth0, GLOO_SOCKET_IFNAME=eth0,
PRTE_MCA_prte_default_hostfile, PRTE_MCA_plm_ssh_agent, OMPI_MCA_btl_tcp_if_include=eth0,
PRTE_MCA_oob_tcp_if_include=eth0, PRTE_MCA_rmaps_default_mapping_policy=slot,
EMULATED_CLUSTER_NODES, EMULATED_CLUSTER_RANKS_PER_NODE, EMULATED_LINK_RATE.
Shaping: rate only is tc tbf (BURST, default 1mb, and LATENCY, default 10ms, from the environment, as in
tools/emulated_link.sh); with --delay or --loss it is tc netem, which the kernel must have.
Everything built is removed when COMMAND ends, fails, or on Ctrl-C; COMMAND's exit status is returned.
EOF
}

NODES=2 RPN=2 RATE=1gbit DELAY=0ms LOSS=""
BURST="${BURST:-1mb}" LATENCY="${LATENCY:-10ms}"   # tbf's bucket and queue, as in tools/emulated_link.sh
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nodes) NODES="${2:?--nodes needs a value}"; shift 2 ;;
        --ranks-per-node) RPN="${2:?--ranks-per-node needs a value}"; shift 2 ;;
        --rate) RATE="${2:?--rate needs a value}"; shift 2 ;;
        --delay) DELAY="${2:?--delay needs a value}"; shift 2 ;;
        --loss) LOSS="${2:?--loss needs a value}"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) die "unknown option '$1' (the command goes after --; see --help)" ;;
    esac
done
[[ $# -ge 1 ]] || die "no command given (put it after --; see --help)"
[[ "$NODES" =~ ^[1-9][0-9]*$ && "$NODES" -le 200 ]] || die "--nodes must be an integer from 1 to 200, not '$NODES'"
[[ "$RPN" =~ ^[1-9][0-9]*$ ]] || die "--ranks-per-node must be a positive integer, not '$RPN'"

[[ $(id -u) -eq 0 ]] || die "needs root: network namespaces, veth links and tc need CAP_SYS_ADMIN/CAP_NET_ADMIN; run as root (e.g. sudo -E)"
for tool in ip tc unshare nsenter; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found: install iproute2 (ip, tc) and util-linux (unshare, nsenter)"
done

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TAG="mpc$$"                      # unique per run: names of namespaces, links, bridge (<= 15 chars for links)
BR="${TAG}br"
WORK="$(mktemp -d /tmp/emulated_cluster.XXXXXX)"
NETNS=()

cleanup() {
    local status=$?
    trap - EXIT INT TERM HUP
    for ns in "${NETNS[@]}"; do
        # Processes left in the namespace (an mpiexec proxy) would keep it alive: end them, then delete it.
        local pids
        pids="$(ip netns pids "$ns" 2>/dev/null || true)"
        [[ -z "$pids" ]] || kill -9 $pids 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
        rm -rf "/etc/netns/$ns"
    done
    for ((i = 0; i < NODES; i++)); do ip link del "${TAG}n$i" 2>/dev/null || true; done
    ip link del "$BR" 2>/dev/null || true
    rm -rf "$WORK"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

netns_of() { echo "${TAG}-node$1"; }

ip link add "$BR" type bridge || die "cannot create a bridge (is the bridge module available?)"
ip link set "$BR" up

HOSTS="$WORK/hosts"
{ echo "127.0.0.1 localhost"; for ((i = 0; i < NODES; i++)); do echo "10.77.0.$((i + 1)) node$i"; done; } >"$HOSTS"
: >"$WORK/hostfile"
for ((i = 0; i < NODES; i++)); do echo "node$i:$RPN" >>"$WORK/hostfile"; done

# Shaping: tbf (rate only) unless a delay or loss is asked, which needs netem (rate, delay, loss in one qdisc).
if [[ "$DELAY" =~ ^0+(\.0*)?(s|ms|us)?$ && -z "$LOSS" ]]; then
    out_qdisc=(tbf rate "$RATE" burst "$BURST" latency "$LATENCY")
    in_qdisc=("${out_qdisc[@]}")
    hint=""
else
    out_qdisc=(netem delay "$DELAY")
    [[ -z "$LOSS" ]] || out_qdisc+=(loss "$LOSS")
    out_qdisc+=(rate "$RATE" limit 100000)
    in_qdisc=(netem rate "$RATE" limit 100000)
    hint=": --delay and --loss need the kernel's sch_netem, which may be missing here; without them it is rate-only shaping (tbf)"
fi
for ((i = 0; i < NODES; i++)); do
    ns="$(netns_of "$i")"
    ip netns add "$ns" || die "ip netns add $ns failed (a container may forbid network namespaces even to root)"
    NETNS+=("$ns")
    mkdir -p "/etc/netns/$ns"
    cp "$HOSTS" "/etc/netns/$ns/hosts"       # ip netns exec bind-mounts it over /etc/hosts, for that process only
    ip link add "${TAG}n$i" type veth peer name eth0 netns "$ns"
    ip link set "${TAG}n$i" master "$BR" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    # Out of the node: rate, and the whole one-way delay and the loss.  Into the node (bridge side): rate only.
    ip netns exec "$ns" tc qdisc add dev eth0 root "${out_qdisc[@]}" ||
        die "tc could not shape node$i's link with '${out_qdisc[*]}'$hint"
    tc qdisc add dev "${TAG}n$i" root "${in_qdisc[@]}" || die "tc could not shape ${TAG}n$i with '${in_qdisc[*]}'"
done

# The launcher Hydra calls instead of ssh: `exec [ssh options] HOST COMMAND...`.
cat >"$WORK/nodeexec" <<EOF
#!/usr/bin/env bash
# Hydra's ssh stand-in for this emulated cluster: enter HOST's namespaces and run the command as ssh would.
while [[ \$# -gt 0 && "\$1" == -* ]]; do shift; done
host="\${1:?no host}"; shift
case "\$host" in
    node[0-9]*) i="\${host#node}" ;;
    10.77.0.*) i=\$(( \${host##*.} - 1 )) ;;
    *) echo "emulated_cluster nodeexec: unknown host '\$host' (nodes are node0..node$((NODES - 1)))" >&2; exit 255 ;;
esac
exec ip netns exec "${TAG}-node\$i" unshare --uts -- sh -c 'hostname "\$0" && exec sh -c "\$1"' "node\$i" "\$*"
EOF
chmod +x "$WORK/nodeexec"

export HYDRA_HOST_FILE="$WORK/hostfile" HYDRA_LAUNCHER=ssh HYDRA_LAUNCHER_EXEC="$WORK/nodeexec"
# Open MPI 5's mpiexec (PRRTE) takes the same nodes from its own hostfile and starts its daemons through the same helper.
for ((i = 0; i < NODES; i++)); do echo "node$i slots=$RPN"; done >"$WORK/hostfile-openmpi"
export PRTE_MCA_prte_default_hostfile="$WORK/hostfile-openmpi" PRTE_MCA_plm_ssh_agent="$WORK/nodeexec"
export OMPI_MCA_btl_tcp_if_include=eth0 PRTE_MCA_oob_tcp_if_include=eth0
# K ranks a node, node0 first, as Hydra places them (a mapping policy from outside, such as tools/setup.sh's
# ":oversubscribe", would keep every rank on node0).
export PRTE_MCA_rmaps_default_mapping_policy=slot
export MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0 GLOO_SOCKET_IFNAME=eth0
export EMULATED_CLUSTER_NODES="$NODES" EMULATED_CLUSTER_RANKS_PER_NODE="$RPN" EMULATED_LINK_RATE="$RATE"

# COMMAND runs on node0 (its namespace, hosts file and hostname); not exec'd, so that cleanup runs after it.
set +e
ip netns exec "$(netns_of 0)" unshare --uts -- sh -c 'hostname node0 && exec "$@"' emulated_cluster "$@"
status=$?
set -e
exit "$status"
