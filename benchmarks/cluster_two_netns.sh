#!/usr/bin/env bash
# Two "hosts" on one machine for cluster_bench.py's throughput figure: network namespaces llampy-a and llampy-b joined
# by a veth pair (10.77.0.1, 10.77.0.2; nothing else reachable), each a Ray node of one CPU pinned to its own core
# (taskset), started with `ray start` as on real hosts; the baseline is one `llampy serve` pinned to core 1 with a
# namespace of its own. The load (cluster_bench.py's clients), Serve's proxy and the ingress run in llampy-a on core 0,
# beside that node's replica: on real hosts they would have cores of their own, so this understates the cluster.
# Run as root from the repository's root:
#     bash benchmarks/cluster_two_netns.sh [MODEL]        (default: SmolLM2; LLAMPY_BENCH_SECONDS, default 20)
set -euo pipefail
MODEL=${1:-$(.venv/bin/python -c 'from llampy.models import smollm2_path; print(smollm2_path())')}
SECONDS_EACH=${LLAMPY_BENCH_SECONDS:-20}
PY=$PWD/.venv/bin/python
RAY=$PWD/.venv/bin/ray
export RAY_USAGE_STATS_ENABLED=0 RAY_worker_niceness=0      # workers at this script's priority, as one server
export RAY_raylet_start_wait_time_s=${RAY_raylet_start_wait_time_s:-120}   # a node on one busy core: Ray's 30 s is short

stop_ns() {     # every process in the namespace (only what this script started), then the namespace
    local pids
    pids=$(ip netns pids "$1" 2>/dev/null || true)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
    ip netns del "$1" 2>/dev/null || true
}
cleanup() { stop_ns llampy-a; stop_ns llampy-b; stop_ns llampy-s; }
trap cleanup EXIT
cleanup
ip netns add llampy-a
ip netns add llampy-b
ip netns add llampy-s
ip link add veth-a type veth peer name veth-b
ip link set veth-a netns llampy-a
ip link set veth-b netns llampy-b
ip -n llampy-a addr add 10.77.0.1/24 dev veth-a
ip -n llampy-b addr add 10.77.0.2/24 dev veth-b
for ns in llampy-a llampy-b llampy-s; do ip -n $ns link set lo up; done
ip -n llampy-a link set veth-a up
ip -n llampy-b link set veth-b up

# the baseline: one server on core 1, its clients (the same load as the cluster's) on core 0
ip netns exec llampy-s taskset -c 1 "$PY" -m llampy serve "$MODEL" --port 8090 --parallel 4 -t 1 \
    --log-format none >/dev/null 2>&1 &
for _ in $(seq 120); do
    ip netns exec llampy-s "$PY" -c 'import httpx; httpx.get("http://127.0.0.1:8090/health").raise_for_status()' \
        2>/dev/null && break
    sleep 0.5
done
ONE=$(ip netns exec llampy-s taskset -c 0 "$PY" -c "
import sys; sys.path.insert(0, 'benchmarks')
import httpx
from cluster_bench import _load
for i in range(2):
    httpx.post('http://127.0.0.1:8090/v1/completions', json={'prompt': f'Warm {i}', 'max_tokens': 4}, timeout=120)
print(_load('http://127.0.0.1:8090', 8, $SECONDS_EACH, 64))")
echo "cluster_two_netns: one server on one core: $ONE tokens/s"
stop_ns llampy-s

ip netns exec llampy-a taskset -c 0 "$RAY" start --head --node-ip-address=10.77.0.1 --port=6379 --num-cpus=1 \
    --include-dashboard=false --disable-usage-stats >/dev/null
ip netns exec llampy-b taskset -c 1 "$RAY" start --address=10.77.0.1:6379 --node-ip-address=10.77.0.2 \
    --num-cpus=1 --disable-usage-stats >/dev/null
OUT=$(mktemp)
ip netns exec llampy-a taskset -c 0 env LLAMPY_BENCH_ADDRESS=10.77.0.1:6379 LLAMPY_BENCH_MODEL="$MODEL" \
    LLAMPY_BENCH_SECONDS="$SECONDS_EACH" "$PY" benchmarks/cluster_bench.py throughput | tee "$OUT"
"$PY" -c "
import json, sys
t = json.loads(open(sys.argv[1]).read().split('cluster_bench: throughput = ')[1].splitlines()[0])
print(f'cluster_two_netns: 2 nodes {t[\"tps_2\"]} tokens/s, one server {$ONE}: scaling against one server '
      f'{t[\"tps_2\"] / (2 * $ONE):.3f} (the target: >= 0.8)')" "$OUT"
rm -f "$OUT"
