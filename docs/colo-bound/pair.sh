#!/bin/bash
# pair.sh BIN MODE(single|pair) EXTRA... : kv VM(s) under kvload 8 connections, 4 s.
BIN=$1; MODE=$2; shift 2
ip netns exec colo-p $BIN run --duration 9 --workload kv --net-tap nlrtap0 --net-ip 10.0.0.2/24 "$@" >/dev/null 2>&1 &
V1=$!
if [ $MODE = pair ]; then
ip netns exec colo-b $BIN run --duration 9 --workload kv --net-tap nlrtap0 --net-ip 10.0.0.3/24 "$@" >/dev/null 2>&1 &
V2=$!
fi
sleep 1
ip netns exec colo-c $BIN kvload --target 10.0.0.2 --duration 4 --connections 8 --keys 400 --timeout 5s --json > /tmp/colo.k1 2>/dev/null &
K1=$!
if [ $MODE = pair ]; then
ip netns exec colo-c $BIN kvload --target 10.0.0.3 --duration 4 --connections 8 --keys 400 --timeout 5s --json > /tmp/colo.k2 2>/dev/null &
K2=$!
fi
wait $K1 ${K2:-}
kill $V1 ${V2:-} 2>/dev/null; wait 2>/dev/null
r1=$(tail -1 /tmp/colo.k1 | python3 -c 'import json,sys; j=json.load(sys.stdin); print("%.0f %s"%(j["ops_per_sec"], j["ok"]))')
if [ $MODE = pair ]; then r2=$(tail -1 /tmp/colo.k2 | python3 -c 'import json,sys; j=json.load(sys.stdin); print("%.0f %s"%(j["ops_per_sec"], j["ok"]))'); fi
echo "$MODE $* : vm1 $r1 ${r2:+vm2 $r2} load $(cut -d' ' -f1 /proc/loadavg)"
