#!/usr/bin/env bash
# Acceptance runs of the I/O engine against fio, on the same file, same
# pattern, interleaved repetition by repetition (fresh random offsets and fio
# seeds each time), medians reported by `flashtier bench io --fio`.
#
#   scripts/bench-io-vs-fio.sh [FILE] [REPS] [SECONDS]
#
# FILE defaults to target/bench-io.bin (8 GiB, created with real data when
# missing). Needs fio (apt-get install -y fio) and a release build.
set -euo pipefail
file=${1:-target/bench-io.bin}
reps=${2:-7}
secs=${3:-3}
bin=${FLASHTIER_BIN:-target/release/flashtier}
[ -x "$bin" ] || cargo build --release -p flashtier-cli
command -v fio >/dev/null || { echo "fio not found: apt-get install -y fio" >&2; exit 1; }

run() { # label target args...
  local label=$1 target=$2; shift 2
  local out
  out=$("$bin" bench io --file "$file" --size 8G --seconds "$secs" --reps "$reps" --fio --json "$@")
  echo "$out" > "target/bench-io-$label.json"
  echo "$out" | jq -r --arg l "$label" --arg t "$target" \
    '"\($l): \(.backend) bs=\(.bs_bytes) qd=\(.qd) \(.pattern): IOPS \(.iops|floor) vs fio \(.fio.engine) \(.fio.median.iops|floor); bytes/s \(.bytes_per_sec/1048576|floor) MiB/s vs \(.fio.median.bytes_per_sec/1048576|floor) MiB/s; ratio IOPS \(.fio.ratio_iops*1000|floor/1000) bytes/s \(.fio.ratio_bytes_per_sec*1000|floor/1000) (target \($t)); lat p50/p99/p999 us \(.lat_us_p50|floor)/\(.lat_us_p99|floor)/\(.lat_us_p999|floor) vs fio \(.fio.median.lat_us_p50|floor)/\(.fio.median.lat_us_p99|floor)/\(.fio.median.lat_us_p999|floor)"'
}

run uring-local-4k-qd32 "(caller-reaped)" --backend uring-local --bs 4k --qd 32 --pattern rand
run uring-4k-qd32 ">=0.90 IOPS" --backend uring --bs 4k --qd 32 --pattern rand
run uring-1m-qd16 ">=0.95 bytes/s" --backend uring --bs 1m --qd 16 --pattern seq
run uring-local-1m-qd16 "(caller-reaped)" --backend uring-local --bs 1m --qd 16 --pattern seq
run posix-4k-qd32 ">=0.80 IOPS" --backend posix --bs 4k --qd 32 --pattern rand

run uring-1m-qd16-rand "(info)" --backend uring --bs 1m --qd 16 --pattern rand
