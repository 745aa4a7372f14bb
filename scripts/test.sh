#!/usr/bin/env bash
# The project's test command: bash scripts/test.sh [go test args...]
#
# Starts a throwaway standalone Redis and a 3-master Redis Cluster on loopback,
# points the tests at them (internal/redistest reads the JOBTHROTTLE_REDIS_*
# variables), runs go vet and go test, and stops every server on exit.
# Installs redis-server, redis-tools and chromium (the status page's test
# drives it headless) with apt-get if they are missing.
# Every test runs; fuzz seed corpora run as ordinary tests. About 4 minutes
# on a 2-core machine with an empty build cache (README.md).
#
# Environment, for the longer runs CI adds (.ci/run):
#   RACE=1      go test -race: the same tests under the race detector
#               (about twice as long: every package is built again)
#   BENCH=1     also the bench module's tests (bench/, own go.mod; they run
#               Redis under valgrind, installed with apt-get if missing)
#   FUZZ=1      also fuzz every target for FUZZTIME (default 5s) each
#               (scripts/fuzz.sh)
#   JOBTHROTTLE_ARTIFACTS=DIR  where tests save what a reader may want to
#               see (the status page's screenshot); else each in its own
#               temporary directory, removed after
#
# Arguments go to go test. Arguments starting with ./ or ../ are package
# patterns and replace ./... (for vet too; BENCH and FUZZ are then
# ignored); give flags with values as -flag=value. Examples:
#   bash scripts/test.sh
#   bash scripts/test.sh ./internal/... -run TestCluster -v
#   RACE=1 BENCH=1 FUZZ=1 bash scripts/test.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SECONDS=0
section() { printf '\n==> %s  (at %ds)\n' "$*" "$SECONDS"; }
die() { printf 'scripts/test.sh: %s\n' "$*" >&2; exit 1; }

section "Redis binaries, chromium"
RACE=${RACE:-0} BENCH=${BENCH:-0} FUZZ=${FUZZ:-0}
# valgrind: the bench's server-cost smoke test counts redis-server's
# instructions under callgrind.
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v chromium >/dev/null || need+=(chromium)
[[ $BENCH != 1 ]] || command -v valgrind >/dev/null || need+=(valgrind)
if ((${#need[@]})); then
	sudo=()
	[[ $(id -u) -eq 0 ]] || sudo=(sudo)
	echo "installing ${need[*]} with apt-get"
	# Lock::Timeout waits for an apt-get already running instead of failing.
	"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq -o DPkg::Lock::Timeout=600 update
	"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq -o DPkg::Lock::Timeout=600 \
		install -y "${need[@]}" >/dev/null
fi
REDIS_SERVER=${JOBTHROTTLE_REDIS_SERVER_BIN:-$(command -v redis-server)}
"$REDIS_SERVER" --version
chromium --version 2>/dev/null || die "chromium --version failed"

TMP=$(mktemp -d "${TMPDIR:-/tmp}/jobthrottle-test.XXXXXX")
PIDS=() PORTS=()

cleanup() {
	local status=$? i
	[[ -z ${TICKER:-} ]] || kill "$TICKER" 2>/dev/null || true
	for i in "${!PIDS[@]}"; do
		[[ -z ${PORTS[i]} ]] || redis-cli -p "${PORTS[i]}" shutdown nosave >/dev/null 2>&1 || true
	done
	for i in "${!PIDS[@]}"; do
		for _ in {1..50}; do kill -0 "${PIDS[i]}" 2>/dev/null || break; sleep 0.1; done
		kill -9 "${PIDS[i]}" 2>/dev/null || true
		wait "${PIDS[i]}" 2>/dev/null || true
	done
	rm -rf "$TMP"
	exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# port_free P: true if nothing accepts connections on 127.0.0.1:P.
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# start_redis PORT ARGS...: start redis-server on 127.0.0.1:PORT and wait
# until it answers, checking by its pid that it is ours and not a server that
# took the port first. Returns 1 if it exits first (the port was taken, say).
start_redis() {
	local port=$1; shift
	"$REDIS_SERVER" --bind 127.0.0.1 --port "$port" --dir "$TMP" \
		--save '' --appendonly no --daemonize no \
		--logfile "$TMP/redis-$port.log" "$@" >>"$TMP/stdout-$port.log" 2>&1 &
	local pid=$!
	PIDS+=("$pid") PORTS+=("") # the port is recorded only once it is ours
	for _ in {1..100}; do
		if redis-cli -p "$port" info server 2>/dev/null | grep -q "^process_id:$pid\b"; then
			PORTS[${#PORTS[@]} - 1]=$port
			return 0
		fi
		kill -0 "$pid" 2>/dev/null || return 1
		sleep 0.1
	done
	tail -n 20 "$TMP/redis-$port.log" >&2 || true
	die "redis-server on port $port did not answer within 10 s"
}

# start_any FIRST ARGS...: start redis-server on the first free port from
# FIRST on (its cluster bus port, +10000, free too); prints the port.
start_any() {
	local first=$1 port; shift
	for ((port = first; port < first + 50; port++)); do
		port_free "$port" && port_free $((port + 10000)) || continue
		start_redis "$port" "$@" && { echo "$port"; return 0; }
	done
	die "no free port for redis-server in $first-$((first + 49)); see $TMP"
}

started=$(date +%s%N)
section "Standalone Redis"
# Not port=$(start_any ...): that runs it in a subshell and loses PIDS.
start_any 16379 >"$TMP/port"
REDIS_PORT=$(<"$TMP/port")
echo "redis-server on 127.0.0.1:$REDIS_PORT"

section "Redis Cluster (3 masters)"
CLUSTER=() next=17100
for _ in 1 2 3; do
	start_any "$next" --cluster-enabled yes --cluster-config-file "$TMP/nodes-$next.conf" \
		--cluster-node-timeout 2000 >"$TMP/port"
	port=$(<"$TMP/port")
	CLUSTER+=("127.0.0.1:$port") next=$((port + 1))
done
redis-cli --cluster create "${CLUSTER[@]}" --cluster-replicas 0 --cluster-yes >"$TMP/cluster-create.log" 2>&1 ||
	{ cat "$TMP/cluster-create.log" >&2; die "redis-cli --cluster create failed"; }
for addr in "${CLUSTER[@]}"; do
	for i in {1..300}; do
		redis-cli -p "${addr##*:}" cluster info 2>/dev/null | grep -q '^cluster_state:ok' && break
		((i < 300)) || die "$addr did not reach cluster_state:ok within 30 s"
		sleep 0.1
	done
done
echo "cluster ${CLUSTER[*]} is ok"
echo "servers ready in $(( ($(date +%s%N) - started) / 1000000 )) ms"

export JOBTHROTTLE_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"
export JOBTHROTTLE_REDIS_CLUSTER
JOBTHROTTLE_REDIS_CLUSTER=$(IFS=,; echo "${CLUSTER[*]}")
export JOBTHROTTLE_REDIS_SERVER_BIN=$REDIS_SERVER
env | grep '^JOBTHROTTLE_' | sort

pkgs=() flags=()
for arg in "$@"; do
	case $arg in .|./*|..|../*) pkgs+=("$arg") ;; *) flags+=("$arg") ;; esac
done
full=$(( ${#pkgs[@]} == 0 ))
((full)) && pkgs=(./...)

section "go vet ${pkgs[*]}"
go vet "${pkgs[@]}"
echo "vet: no findings"

race=()
[[ $RACE != 1 ]] || race=(-race)
section "go test ${race[*]} ${pkgs[*]}"
status=0
test_pkgs=("${pkgs[@]}")
if ((full)); then
	# The packages whose tests take longest are named first: go test starts
	# the packages' tests in the order given, -p of them at once (2 on CI),
	# so these start at once instead of after the short ones (./... runs
	# the rest, and each package once). reliability's first tests and
	# throttle's load the CPU; the root package's end-to-end tests, which
	# need it, start once throttle's are done, beside reliability's tests
	# that mostly wait.
	test_pkgs=()
	for p in ./reliability ./throttle .; do [[ -d $p ]] && test_pkgs+=("$p"); done
	test_pkgs+=(./...)
fi
# go test prints a package's result only once those named before it are
# done, so say every 30 s which test binaries are running.
(
	while sleep 30; do
		running=$(ps -eo args= | awk '$1 ~ /\.test$/ { n = split($1, p, "/"); print p[n] }' | sort -u | tr '\n' ' ')
		printf '    ... at %ds: %s\n' "$SECONDS" "${running:-building}"
	done
) &
TICKER=$!
go test "${race[@]}" -shuffle=on -count=1 -timeout 30m "${flags[@]}" "${test_pkgs[@]}" || status=$?
kill "$TICKER" 2>/dev/null || true
TICKER=

if ((full)) && [[ $BENCH == 1 && -f bench/go.mod ]]; then
	section "bench (own module)"
	(cd bench && go vet ./... && go test -count=1 -timeout 10m ./...) || { s=$?; ((status)) || status=$s; }
fi

if ((full)) && [[ $FUZZ == 1 ]]; then
	# Every fuzz target, briefly: the seed corpora already ran as tests above.
	# Only the packages that have one are listed, so that finding the
	# targets (go test -list) does not build every package's tests again.
	section "fuzz (FUZZTIME=${FUZZTIME:-5s} per target)"
	mapfile -t fuzz_pkgs < <(grep -rl --include='*_test.go' '^func Fuzz' . | grep -v '^\./bench/' | xargs -rn1 dirname | sort -u)
	FUZZTIME=${FUZZTIME:-5s} bash scripts/fuzz.sh "${fuzz_pkgs[@]}" || { s=$?; ((status)) || status=$s; }
fi

section "done"
((status == 0)) && echo "all tests passed" || echo "tests FAILED (exit $status)"
exit "$status"
