#!/usr/bin/env bash
# The Quickstart's first install timed as a new user meets it: a fresh clone
# of REV, a fresh virtualenv, an empty pip cache (so a revision that installs
# llama-cpp-python compiles it from its sdist, having no Linux wheel on PyPI;
# since the llama extra, the default install compiles only edgespec's C core). It runs the install
# half of the README's first Quickstart line at that revision (the part before
# `&& edgespec demo`), so two revisions are timed the same way their READMEs
# tell a user to install them.
#
#   benchmarks/bench_install.sh [REV] [--demo]
#
# --demo then times `edgespec demo` with an empty model cache ($EDGESPEC_HOME),
# so the first model's download is in it. Prints the wall and CPU times, the
# load average around the run (the machine may be shared) and, where
# llama-cpp-python was built, where its build spent its time (its ninja log,
# summed per folder).
set -euo pipefail
rev=${1:-HEAD}
demo=${2:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

git clone -q "$repo" "$work/src"
cd "$work/src"
git checkout -q "$rev"
install=$(grep -m1 -E '^pip install .*&& edgespec demo' README.md | sed 's/ *&& edgespec demo.*//')
echo "rev $(git rev-parse --short HEAD): $install"
python3 -m venv "$work/venv"
. "$work/venv/bin/activate"
export PIP_CACHE_DIR="$work/pip-cache" SKBUILD_BUILD_DIR="$work/llama-build"

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
# CPU seconds beside the wall time: on a shared machine the wall time
# stretches with the others' load, the work done much less.
/usr/bin/time -f '%e %U %S' -o "$work/time" bash -c "$install" > "$work/install.log" 2>&1 \
    || { tail -n 20 "$work/install.log"; exit 1; }
echo "load after:  $(cut -d' ' -f1-3 /proc/loadavg)"
read -r wall user sys < "$work/time"
printf 'install: %.0f s wall, %.0f s CPU (user+sys)\n' "$wall" "$(echo "$user + $sys" | bc)"

# .ninja_log: start and end (ms) of every build step; their wall times summed
# per folder (with ninja's parallel jobs and others' load these exceed the CPU time).
[ -f "$SKBUILD_BUILD_DIR/.ninja_log" ] && python3 - "$SKBUILD_BUILD_DIR/.ninja_log" <<'EOF'
import collections, sys
per = collections.Counter()
for line in open(sys.argv[1]):
    if line.startswith("#"):
        continue
    start, end, _, out, _ = line.rstrip("\n").split("\t")
    parts = out.split("/")
    per["/".join(parts[:3]) if parts[0] == "vendor" else parts[0]] += (int(end) - int(start)) / 1000
print(f"llama-cpp-python build steps, wall seconds summed: {sum(per.values()):.0f}")
for folder, s in per.most_common(12):
    print(f"  {s:7.0f} s  {folder}")
EOF

if [ "$demo" = --demo ]; then
    export EDGESPEC_HOME="$work/edgespec-home"
    /usr/bin/time -f '%e' -o "$work/time" edgespec demo
    printf 'demo (empty model cache): %.0f s wall\n' "$(cat "$work/time")"
fi
