#!/usr/bin/env bash
# Tests on a real multi-host network: two hosts of scripts/netns-cluster
# (network + UTS namespaces, TCP between them), 2 ranks each.
#
#   netns_test.sh CASE APPS_DIR SOURCE_DIR
#
# CASE:
#   outputs    kmoe-topo finds 2 nodes from the hosts' names; the four
#              exchanges of tests/netns/layer_hosts.toml across the hosts give
#              the output digests of the same deck on one host (virtual nodes
#              of the same layout), bit for bit; kmoe-exchange's ledgers equal
#              the planner's on the hosts.
#   link_down  a host's data link taken down mid-run ends the job within the
#              watchdog + 30 s, naming an unreachable peer's host and node.
#   shaped     the data links shaped to 10 Mbit/s: slower, nothing lost (the
#              same digests, no drops, ledgers equal the planner's).
#
# Exits 77 (ctest: skipped), with the reason, where network namespaces cannot
# be made (not root, iproute2 missing, no permission). Every case removes its
# hosts (trap), under a name of its own (KMOE_NETNS_NAME).
set -uo pipefail

case_name=${1:?case}
apps=${2:?apps dir}
src=${3:?source dir}
cluster="$src/scripts/netns-cluster"
here="$src/tests/netns"

skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAILED: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || skip "not root (network namespaces, veth pairs and tc need root)"
command -v ip >/dev/null 2>&1 || skip "'ip' is missing (iproute2)"
command -v tc >/dev/null 2>&1 || skip "'tc' is missing (iproute2)"
command -v unshare >/dev/null 2>&1 || skip "'unshare' is missing (util-linux)"
command -v python3 >/dev/null 2>&1 || skip "python3 is missing"
probe="kmoeprobe$$"
ip netns add "$probe" >/dev/null 2>&1 || skip "cannot create a network namespace here ('ip netns add' failed)"
ip netns del "$probe" >/dev/null 2>&1

# Names and networks of their own, apart from a cluster of the default name.
case "$case_name" in
  outputs) export KMOE_NETNS_NAME=kto KMOE_NETNS_NET=200 ;;
  link_down) export KMOE_NETNS_NAME=ktl KMOE_NETNS_NET=202 ;;
  shaped) export KMOE_NETNS_NAME=kts KMOE_NETNS_NET=204 ;;
  *) fail "unknown case '$case_name' (outputs, link_down, shaped)" ;;
esac
name=$KMOE_NETNS_NAME
work=$(mktemp -d "/tmp/kmoe-netns-$case_name.XXXXXX")
cleanup() {
  "$cluster" down >/dev/null 2>&1
  rm -rf "$work"
  if ip netns list 2>/dev/null | grep -qE "^${name}-h[0-9]+"; then
    echo "FAILED: namespaces of ${name} left behind"
    exit 1
  fi
}
trap cleanup EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 OMP_PROC_BIND=false OMP_WAIT_POLICY=passive

# The deck of the hosts, and the same deck on one host: 2 virtual nodes of 2
# consecutive ranks, the layout the hostfile gives.
virtual_deck() {  # in out
  sed 's/^layout = "hwloc"$/layout = "virtual"\nnodes = 2/' "$1" > "$2"
  grep -q '^layout = "virtual"$' "$2" || fail "could not make the one-host copy of $1"
}

# field of a kmoe-layer report: every algorithm's output digest and drops.
digests() {  # report
  python3 - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
for name, a in sorted(r["algorithms"].items()):
    led = a["ledger_last_step"]["dispatch"]
    drops = a["routes"]["dropped"] + led.get("sender_drops", 0) + led.get("receiver_drops", 0)
    print(f"{name} digest={a['output_digest']} drops={drops}")
EOF
}

run_layer_both() {  # tag
  local tag=$1
  virtual_deck "$here/layer_hosts.toml" "$work/layer_one_host.toml"
  mpiexec --oversubscribe -n 4 "$apps/kmoe-layer" "$work/layer_one_host.toml" --report "$work/one_host.json" \
    > "$work/one_host.log" 2>&1 || { cat "$work/one_host.log"; fail "the one-host run failed"; }
  "$cluster" mpiexec -n 4 "$apps/kmoe-layer" "$here/layer_hosts.toml" --report "$work/hosts.json" \
    > "$work/hosts.log" 2>&1 || { cat "$work/hosts.log"; fail "the run across the hosts failed ($tag)"; }
  cat "$work/hosts.log"
  python3 - "$work/hosts.json" <<'EOF' || fail "the run across the hosts did not see 2 nodes"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["nodes"] == 2, r["nodes"]
EOF
  grep -q "compare_identical=yes" "$work/hosts.log" || fail "the algorithms disagree across the hosts ($tag)"
  digests "$work/one_host.json" > "$work/one_host.digests"
  digests "$work/hosts.json" > "$work/hosts.digests"
  echo "one host:"; cat "$work/one_host.digests"
  echo "hosts ($tag):"; cat "$work/hosts.digests"
  [ "$(wc -l < "$work/hosts.digests")" -eq 4 ] || fail "expected 4 algorithms in the report"
  cmp -s "$work/one_host.digests" "$work/hosts.digests" || fail "outputs across the hosts differ from the one-host run ($tag)"
  if grep -v " drops=0$" "$work/hosts.digests"; then fail "routes dropped ($tag)"; fi
}

run_exchange_planner() {  # tag
  "$cluster" mpiexec -n 4 "$apps/kmoe-exchange" "$here/exchange_hosts.toml" --report "$work/exchange.json" \
    > "$work/exchange.log" 2>&1 || { cat "$work/exchange.log"; fail "kmoe-exchange across the hosts failed ($1)"; }
  cat "$work/exchange.log"
  grep -q "4 ranks on 2 nodes" "$work/exchange.log" || fail "kmoe-exchange did not see 2 nodes ($1)"
  grep -q "planner check: every rank's ledger predicted exactly" "$work/exchange.log" || fail "ledgers differ from the planner's ($1)"
}

case "$case_name" in
  outputs)
    "$cluster" up 2 || fail "netns-cluster up failed"
    # Later commands find the cluster's networks from its state alone.
    env -u KMOE_NETNS_NET "$cluster" status > "$work/status.log" 2>&1 || { cat "$work/status.log"; fail "netns-cluster status failed"; }
    grep -q "^$name-h1  198\.18\.$KMOE_NETNS_NET\.2/24" "$work/status.log" || { cat "$work/status.log"; fail "netns-cluster status: wrong networks"; }
    "$cluster" mpiexec -n 4 "$apps/kmoe-topo" --json "$work/topo.json" > "$work/topo.log" 2>&1 ||
      { cat "$work/topo.log"; fail "kmoe-topo across the hosts failed"; }
    cat "$work/topo.log"
    python3 - "$work/topo.json" "$name" <<'EOF' || fail "kmoe-topo: wrong nodes, hosts or relays"
import json, sys
t = json.load(open(sys.argv[1]))
name = sys.argv[2]
ranks = t["ranks"]
hosts = [r["host"] for r in ranks]
nodes = [r["node"] for r in ranks]
assert hosts == [f"{name}-h0", f"{name}-h0", f"{name}-h1", f"{name}-h1"], hosts
assert nodes == [0, 0, 1, 1], nodes
assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
assert t["layout"] == "hwloc", t["layout"]
assert t["node_groups"] == [[0, 1], [2, 3]], t["node_groups"]
assert t["relays"] == [[0], [2]], t["relays"]
assert t["relay_groups"] == [[0, 2]], t["relay_groups"]
assert t["ep_order"] == [0, 1, 2, 3], t["ep_order"]
print("kmoe-topo: 2 nodes from the host names, relays 0 and 2, peer slots in rank order")
EOF
    run_layer_both unshaped
    run_exchange_planner unshaped
    ;;
  shaped)
    "$cluster" up 2 --link-gbps 0.01 || fail "netns-cluster up failed"
    "$cluster" status
    run_layer_both "10 Mbit/s"
    run_exchange_planner "10 Mbit/s"
    ;;
  link_down)
    "$cluster" up 2 || fail "netns-cluster up failed"
    watchdog=10
    sed "s/^watchdog_seconds = .*/watchdog_seconds = $watchdog/; s/^steps = .*/steps = 100000\nprogress_every = 5/" "$here/layer_hosts.toml" > "$work/long.toml"
    "$cluster" mpiexec -n 4 "$apps/kmoe-layer" "$work/long.toml" --report "$work/long.json" > "$work/long.log" 2>&1 &
    job=$!
    # Running across both hosts: the first progress line (every 5 steps).
    for _ in $(seq 1 120); do
      grep -q "^progress: step" "$work/long.log" && break
      kill -0 "$job" 2>/dev/null || { cat "$work/long.log"; fail "the job ended before the link went down"; }
      sleep 0.5
    done
    grep -q "^progress: step" "$work/long.log" || { pkill -f "$work/long.toml"; kill "$job" 2>/dev/null; cat "$work/long.log"; fail "no progress in 60 s"; }
    "$cluster" link "${name}-h1" down || fail "could not take ${name}-h1's link down"
    down_at=$(date +%s)
    limit=$((watchdog + 30))
    ended=0
    for _ in $(seq 1 $((2 * (limit + 30)))); do
      kill -0 "$job" 2>/dev/null || { ended=1; break; }
      sleep 0.5
    done
    if [ "$ended" = 0 ]; then
      pkill -f "$work/long.toml" 2>/dev/null
      kill "$job" 2>/dev/null
      cat "$work/long.log"
      fail "the job still ran $((limit + 30)) s after the link went down"
    fi
    wait "$job"
    rc=$?
    took=$(( $(date +%s) - down_at ))
    cat "$work/long.log"
    echo "the job ended $took s after the link went down (exit $rc)"
    [ "$rc" -ne 0 ] || fail "the job succeeded although a link was down"
    [ "$took" -le "$limit" ] || fail "the job took $took s to end (watchdog $watchdog s + 30 s = $limit s)"
    # A watched collective names the ranks that did not answer; a transfer
    # wait names the peers it still waits for: then a rank of one host
    # (ranks 0-1 on h0, 2-3 on h1) must name a peer across the link.
    grep -qE "no answer from rank.* on host ${name}-h[01], node [01]|\(rank [01]\):.*still waiting to receive from.* on host ${name}-h1, node 1|\(rank [23]\):.*still waiting to receive from.* on host ${name}-h0, node 0" "$work/long.log" ||
      fail "no message naming the unreachable peer's host and node"
    ;;
esac
echo "netns $case_name: ok"
