#!/bin/bash
# Two kv VMs' networks: C (client, br0 10.0.0.1), P and B each with a TAP
# bridged to C. Usage: topo.sh up|down
set -e
if [ "$1" = down ]; then for n in colo-c colo-p colo-b; do ip netns del $n 2>/dev/null || true; done; exit 0; fi
for n in colo-c colo-p colo-b; do ip netns add $n; ip -n $n link set lo up; done
ip -n colo-c link add br0 type bridge ageing_time 0; ip -n colo-c addr add 10.0.0.1/24 dev br0; ip -n colo-c link set br0 up
for x in p b; do
  ip -n colo-$x link add br0 type bridge ageing_time 0; ip -n colo-$x link set br0 up
  ip -n colo-$x tuntap add dev nlrtap0 mode tap; ip -n colo-$x link set nlrtap0 master br0; ip -n colo-$x link set nlrtap0 up
  ip -n colo-$x link add up0 type veth peer name c$x netns colo-c
  ip -n colo-$x link set up0 master br0; ip -n colo-$x link set up0 up
  ip -n colo-c link set c$x master br0; ip -n colo-c link set c$x up
done
