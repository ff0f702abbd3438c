#!/bin/sh
# $1 = start|stop, $2 = netns name, $3 = k ; env OUT dir, PERF=1 to record
what=$1; ns=$2; k=$3
d=${OUT:-/tmp/f11}; mkdir -p $d
tag=$d/$ns-k$k-$what-$(date +%s%N)
{
 echo "== ip -s link"; ip netns exec $ns ip -s -s link show
 echo "== tc"; ip netns exec $ns tc -s qdisc
 echo "== nstat"; ip netns exec $ns nstat -az Udp* Ip*InDiscards Ip*OutDiscards Ip*OutNoRoutes IpExt*
 echo "== softnet"; cat /proc/net/softnet_stat
 echo "== loadavg"; cat /proc/loadavg
} > $tag.txt 2>&1
if [ "$what" = start ] && [ -n "$PERF" ]; then
  nohup /usr/bin/perf record -a -g -o $d/$ns-k$k.perf.data -- sleep ${PERF_S:-1} > $d/perf.log 2>&1 &
fi
if [ "$what" = start ] && [ -n "$PSTAT" ]; then
  nohup /usr/bin/perf stat -a -e task-clock,context-switches,cpu-migrations,cycles,instructions -o $d/$ns-k$k-$(date +%s%N).stat -- sleep ${PERF_S:-1} > /dev/null 2>&1 &
fi
if [ "$what" = start ] && [ -n "$PTHR" ]; then
  bpid=$(ps -o ppid= $PPID | tr -d ' ')
  nohup /usr/bin/perf stat --per-thread -p $bpid -e task-clock -o $d/$ns-k$k-$(date +%s%N).thr -- sleep ${PERF_S:-1} > /dev/null 2>&1 &
fi
if [ -n "$SCHED" ]; then
  bpid=$(ps -o ppid= $PPID | tr -d ' ')
  for t in /proc/$bpid/task/*; do echo "$(cat $t/comm) $(cat $t/schedstat) $(grep -E 'voluntary_ctxt_switches|nonvoluntary_ctxt_switches' $t/status | awk '{print $2}' | tr '\n' ' ')"; done > $tag.sched
fi
if [ "$what" = start ] && [ -n "$PSCHED" ]; then
  nohup /usr/bin/perf sched record -o $d/$ns-k$k.sched.data -- sleep ${PERF_S:-1} > /dev/null 2>&1 &
fi
if [ "$what" = start ] && [ -n "$NL_NOQ" ]; then
  ip netns exec $ns tc qdisc replace dev nltap0 root noqueue
fi
if [ "$what" = start ] && [ -n "$NL_SLICE" ]; then
  bpid=$(ps -o ppid= $PPID | tr -d ' ')
  tids=$(for t in /proc/$bpid/task/*; do grep -q netrx $t/comm && basename $t; done)
  python3 /work/wt-link-exp/slice.py $NL_SLICE $tids
fi
if [ "$what" = start ] && [ -n "$NL_SETTLE" ]; then
  sleep $NL_SETTLE
fi
