#!/usr/bin/env bash
# Runs every fuzz target of the module, one after another, each for a
# bounded time: bash scripts/fuzz.sh [package patterns...]
#
#   FUZZTIME   how long each target fuzzes (go test -fuzztime): default 20s;
#              CI uses a few seconds (see scripts/test.sh)
#   FUZZFLAGS  extra go test flags, e.g. FUZZFLAGS=-parallel=2
#
# Targets are found with go test -list '^Fuzz', so a new Fuzz function is
# picked up without editing this file. A failing input is written under the
# package's testdata/fuzz/<Target>/ (commit it as a regression seed once
# fixed); the script keeps going and exits non-zero if any target failed.
# Targets that check scripts on a real Redis do so when JOBTHROTTLE_REDIS_URL
# is set (scripts/test.sh sets it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

FUZZTIME=${FUZZTIME:-20s}
read -r -a extra <<<"${FUZZFLAGS:-}"
pkgs=("$@")
((${#pkgs[@]})) || pkgs=(./...)

# go test -list prints a package's matching names, then its "ok <pkg>" line.
targets=() names=()
while read -r first second _; do
	case $first in
	Fuzz*) names+=("$first") ;;
	ok)
		for n in "${names[@]}"; do targets+=("$second $n"); done
		names=()
		;;
	*) names=() ;;
	esac
done < <(go test -list '^Fuzz' "${pkgs[@]}")

((${#targets[@]})) || { echo "scripts/fuzz.sh: no fuzz targets in ${pkgs[*]}" >&2; exit 1; }
echo "fuzzing ${#targets[@]} targets for $FUZZTIME each"

# fuzz PKG NAME: one bounded run. go's fuzzing engine sometimes ends a run
# that found nothing with only "context deadline exceeded" when -fuzztime
# is short (its coordinator stops a worker mid-input); a real finding always
# writes "Failing input written to". Such a run is tried once more, and
# fails only if that happens twice.
fuzz() {
	local out
	out=$(mktemp)
	if go test -run '^$' -fuzz "^$2\$" -fuzztime "$FUZZTIME" "${extra[@]}" "$1" 2>&1 | tee "$out"; then
		rm -f "$out"
		return 0
	fi
	if grep -q 'context deadline exceeded' "$out" && ! grep -q 'Failing input written to' "$out"; then
		rm -f "$out"
		echo "scripts/fuzz.sh: $2 stopped with only 'context deadline exceeded' (no failing input); running it once more"
		go test -run '^$' -fuzz "^$2\$" -fuzztime "$FUZZTIME" "${extra[@]}" "$1"
		return
	fi
	rm -f "$out"
	return 1
}

failed=()
for t in "${targets[@]}"; do
	pkg=${t% *} name=${t#* }
	printf '\n==> %s %s\n' "$pkg" "$name"
	fuzz "$pkg" "$name" || failed+=("$pkg $name")
done

if ((${#failed[@]})); then
	printf '\nscripts/fuzz.sh: %d of %d targets FAILED:\n' "${#failed[@]}" "${#targets[@]}" >&2
	printf '  %s\n' "${failed[@]}" >&2
	exit 1
fi
printf '\nscripts/fuzz.sh: all %d targets passed\n' "${#targets[@]}"
