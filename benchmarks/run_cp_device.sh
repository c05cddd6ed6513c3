#!/usr/bin/env bash
# benchmarks/control_plane.py on the device machine (16 x86-64 cores, Python 3.12, no gRPC,
# no etcd; the GPU is not used): issue 17's etcd runs where the server, the load generator
# and three etcd members do not share 2 cores. Run from a checkout's root there; results
# (JSON + log) go to $OUT (or ./out), one file per run.
#
# What must travel with the checkout (ignored folders named in the device call's carry):
#   .whl/        cp312 manylinux wheels of exactly the versions in pyproject.toml's
#                dependencies: grpcio 1.85.3, protobuf 7.36.2, grpcio-health-checking 1.85.1,
#                grpcio-reflection 1.85.1, grpcio-status 1.85.3, googleapis-common-protos
#                1.76.0, structlog 26.1.0, prometheus_client 0.26.0, opentelemetry-api/-sdk/
#                -proto/-exporter-otlp-proto-grpc/-exporter-otlp-proto-common 1.45.2,
#                opentelemetry-semantic-conventions and -exporter-otlp-common 0.66b2,
#                uvloop 0.23.0, typing_extensions 4.16.0 (17 wheels, 13 MB), fetched with
#                python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                  --implementation cp --platform manylinux2014_x86_64 [...] -d .whl NAME==VERSION
#   .devbin/etcd.gz  gzip -9 of the etcd binary the tests use (/usr/bin/etcd, 3.4.23; 7.5 MB)
#   .devscripts/control_plane.py  only where the checkout's benchmarks/control_plane.py is
#                older than the one measured (then .devscripts/COMMIT says which commit it is)
#
# Usage: [SUFFIX=_rep2] bash benchmarks/run_cp_device.sh COMMIT WHAT...   WHAT: smoke | etcd | memory | replicas | shapes[1|2] | fleet_etcd
#   smoke     one short memory-store point and one short point over 2 replicas on etcd
#   etcd      etcd (3 members), session path, one server, the load from one process (the
#             product's defaults, the issue's target), 250/s up until saturated
#   memory    memory store, session path, 500/s and 1,000/s (a reference on this machine)
#   replicas  etcd (3 members), session path, 1, 2 and 4 server replicas, the load from 4
#             processes, one results file per replica count
#   shapes    memory store, session-answer vs the floor: 1 engine pair, 8 pairs, 8 pairs at prefill
#             TP 4, then 8 pairs at TP 4 and 1 pair over mutual TLS + tokens (needs openssl);
#             shapes1 / shapes2: the first three / the last two (one device call each)
#   fleet_etcd  etcd (3 members), 2 replicas, 8 engine pairs at prefill TP 4, mutual TLS + tokens
set -uo pipefail
commit=${1:?commit measured}; shift
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
# Always these wheels, ahead of anything the machine's Python has (it may carry other
# grpcio/uvloop versions).
[ -d /tmp/site/grpc ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/bin
[ -x /tmp/bin/etcd ] || { gunzip -c .devbin/etcd.gz > /tmp/bin/etcd && chmod +x /tmp/bin/etcd; } || exit 1
# kvbaton.services -> services/, kvbaton.connector -> connector/: what the editable install maps.
[ -e kvbaton/services ] || ln -s ../services kvbaton/services
[ -e kvbaton/connector ] || ln -s ../connector kvbaton/connector
export PATH=/tmp/bin:$PATH PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
CP=benchmarks/control_plane.py
[ -f .devscripts/control_plane.py ] && { CP=.devscripts/control_plane.py; commit="$commit, $CP of $(cat .devscripts/COMMIT)"; }
model=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
machine="device machine: $(nproc) cores ($model), $(awk '/MemTotal/{printf "%d", $2/1048576}' /proc/meminfo) GiB, kernel $(uname -r), one NVIDIA H200 unused; NOT the 2-core VM"
echo "$machine"; uptime; etcd --version | head -1; python3 --version
python3 -c "import grpc, uvloop, google.protobuf as p; print('grpcio', grpc.__version__, 'from', grpc.__file__, 'uvloop', uvloop.__version__, 'protobuf', p.__version__)"
cp_run() {  # name, then control_plane.py arguments
  local name=$1; shift
  echo "== $name: $CP $*"
  timeout 540 python3 "$CP" "$@" --machine "$machine" --commit "$commit" --out "$OUT/control_plane_device_$name${SUFFIX:-}.json" \
    2>&1 | grep -v -E 'kvbaton.PLAINTEXT|kvbaton listening|session_shed_retry|^$' | tee -a "$OUT/control_plane_device${SUFFIX:-}.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name rc=$rc"
  return "$rc"
}
for what in "$@"; do
  case $what in
    smoke)
      cp_run smoke_memory --store memory:// --path session --rate 300 --seconds 1 --grace 2 || exit 1
      cp_run smoke_replicas --store etcd3 --path session --rate 100 --seconds 1 --grace 2 --replicas 2 --generators 2 \
        --generator-start-s 3 || exit 1
      rm -f "$OUT"/control_plane_device_smoke_*.json ;;
    etcd)
      cp_run etcd3 --store etcd3 --path session --rate 250 --rate 500 --rate 750 --rate 1000 --rate 1500 --rate 2000 \
        --seconds 5 ;;
    memory)
      cp_run memory --store memory:// --path session --rate 500 --rate 1000 --seconds 5 ;;
    replicas)
      for n in 1 2 4; do
        cp_run "replicas$n" --store etcd3 --path session --rate 500 --rate 1000 --rate 1500 --rate 2000 --rate 3000 \
          --rate 4000 --seconds 5 --replicas "$n" --generators 4 --generator-start-s 4
      done ;;
    shapes|shapes1|shapes2)
      # Issue 17's CPU target in the fleet's shape: one engine pair (the target's own
      # shape), 8 pairs (one generator process each), 8 pairs with prefill TP 4 (a
      # Subscribe stream per writing rank, each getting the MATCH), and both with mutual TLS
      # and tokens as the shipped deploy runs; memory store, session-answer, this server
      # against the floor (canned answers) in two rounds of alternating order.
      common=(--store memory:// --path session-answer --rate 250 --rate 500 --seconds 5 --grace 3
              --no-stop-when-saturated --floor --rounds 2 --generator-start-s 3)
      if [ "$what" != shapes2 ]; then
        cp_run shape_1pair "${common[@]}" || exit 1
        cp_run shape_8pairs "${common[@]}" --generators 8 || exit 1
        cp_run shape_8pairs_tp4 "${common[@]}" --generators 8 --tp 4 || exit 1
      fi
      if [ "$what" != shapes1 ]; then
        cp_run shape_8pairs_tp4_mtls "${common[@]}" --generators 8 --tp 4 --secure || exit 1
        cp_run shape_1pair_mtls "${common[@]}" --secure || exit 1
      fi ;;
    fleet_etcd)
      # The fleet's shape on etcd (3 members): 8 engine pairs at prefill TP 4 over mutual TLS
      # and tokens, two server replicas (each pair's decode on one, its prefill on the other),
      # the issue's p99 <= 20 ms at 250/s and one point above.
      cp_run fleet_etcd3_2replicas --store etcd3 --path session-answer --rate 250 --rate 500 --seconds 5 --grace 3 \
        --no-stop-when-saturated --generators 8 --tp 4 --secure --replicas 2 --generator-start-s 3 || exit 1 ;;
    *) echo "unknown: $what"; exit 2 ;;
  esac
done
uptime
