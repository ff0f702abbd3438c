#!/usr/bin/env bash
# Runs every fuzz target (or those named) for a bounded time each and prints
# executions and findings per target.
#
#   fuzz/run.sh [-t SECONDS] [TARGET...]      default: 60 s per target
#
# Uses cargo-fuzz (libFuzzer) on the stable compiler: RUSTC_BOOTSTRAP=1 lets
# stable rustc take the -Z flags cargo fuzz passes. Install it once with
# `cargo install cargo-fuzz`. Seeds come from fuzz/seeds/TARGET (kept in
# git); what the fuzzer adds goes to a scratch corpus under fuzz/work/.
# A crash leaves its input in fuzz/artifacts/TARGET/ and the run exits 1.
set -euo pipefail
cd "$(dirname "$0")"
secs=60
if [ "${1:-}" = "-t" ]; then secs=$2; shift 2; fi
command -v cargo-fuzz >/dev/null 2>&1 || { echo "run.sh: cargo-fuzz is missing (cargo install cargo-fuzz)" >&2; exit 2; }
export RUSTC_BOOTSTRAP=1
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo fuzz list)
cargo fuzz build -O >/dev/null
bin=target/x86_64-unknown-linux-gnu/release
printf '%-18s %10s %8s %10s %s\n' target execs exec/s seconds outcome
failed=0
for t in "${targets[@]}"; do
    mkdir -p "work/$t" "seeds/$t" "artifacts/$t"
    log="work/$t.log"
    set +e
    dict=(); [ -f "seeds/$t.dict" ] && dict=(-dict="seeds/$t.dict")
    "$bin/$t" "work/$t" "seeds/$t" "${dict[@]}" -max_total_time="$secs" -max_len=65536 -timeout=10 \
        -rss_limit_mb=4096 -artifact_prefix="artifacts/$t/" -print_final_stats=1 >"$log" 2>&1
    rc=$?
    set -e
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    outcome=clean
    if [ $rc -ne 0 ]; then
        outcome="FOUND (exit $rc): $(ls -t "artifacts/$t" | head -1) — see $log"
        failed=1
    fi
    printf '%-18s %10s %8s %10s %s\n' "$t" "${execs:-?}" "${rate:-?}" "$secs" "$outcome"
done
exit $failed
