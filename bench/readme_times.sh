#!/usr/bin/env bash
# Measures the time figures the README quotes (`make run`, `make test`), from a fresh clone of this
# checkout's HEAD, and saves them with the date, commit and host in
# bench/results/readme_times_<class>_<vendor>.json; then bench/readme_table.py regenerates the timing
# table in docs/benchmarks.md from every such record. Run on an idle machine of the kind the README
# names (2 cores): `make bench-readme`. Set-up (venv, installs, model conversion) is timed apart, since
# the figures are "after set-up". SKIP_TEST=1 times make run alone (make_test_s is then 0: no row).
# <class> is avx512 or avx2 from the CPU's flags and <vendor> amd or intel (so that the CPU kinds these
# machines come in keep their own records); the host record is bench/host.py's (CPU model, flags,
# commit). FORCE_AVX2=1 on an AVX-512 host runs both commands with ATEN_CPU_CAPABILITY=avx2
# ONEDNN_MAX_CPU_ISA=AVX2 and saves readme_times_avx2_<vendor>_approx.json marked "approximation": an
# AVX-512 core forced to AVX2 kernels, not an AVX2-only CPU (whose own record it never overwrites).
set -euo pipefail
src=$(git rev-parse --show-toplevel)
commit=$(git -C "$src" rev-parse --short HEAD)
work=$(mktemp -d)
logs="$src/runs/readme-times"  # the logs and make run's run directory are kept here (runs/ is not tracked)
rm -rf "$logs" && mkdir -p "$logs"
trap 'cp -r "$work/leafe/runs/default" "$logs/" 2>/dev/null; rm -rf "$work"' EXIT
git clone -q "$src" "$work/leafe"
cd "$work/leafe"
# The set-up reuses the machine's pip cache like a second clone would; the model cache is the clone's own.
load_before=$(cut -d' ' -f1-3 /proc/loadavg)  # before anything runs (the machine should be idle)
t0=$(date +%s); make setup >/dev/null; t1=$(date +%s)
class=avx2; grep -qw avx512f /proc/cpuinfo && class=avx512
vendor=$(awk -F': ' '/^vendor_id/ {print $2; exit}' /proc/cpuinfo | sed 's/AuthenticAMD/amd/; s/GenuineIntel/intel/' | tr -cd 'a-zA-Z0-9')
approx=0; suffix=
if [ -n "${FORCE_AVX2:-}" ] && [ "$class" = avx512 ]; then
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2; class=avx2; approx=1; suffix=_approx
fi
host=$(.venv/bin/python -c "import json; from bench.host import host_record; print(json.dumps(host_record()))")
.venv/bin/python -c "from leafe.learner.model_io import default_model_dir; default_model_dir()" >/dev/null 2>&1 || true
t2=$(date +%s); run_rc=0; make run ARGS="--no-live" > "$logs/run.log" 2>&1 || run_rc=$?; t3=$(date +%s)
t4=$(date +%s); test_rc=0
if [ -z "${SKIP_TEST:-}" ]; then make test > "$logs/test.log" 2>&1 || test_rc=$?; else echo "skipped (SKIP_TEST)" > "$logs/test.log"; fi
t5=$(date +%s)
report=runs/default/report.json
python3 - "$src/bench/results/readme_times_${class}_${vendor:-unknown}${suffix}.json" "$commit" "$((t1 - t0))" "$((t3 - t2))" "$((t5 - t4))" "$report" "$run_rc" "$test_rc" "$logs/test.log" "$load_before" "$host" "$approx" <<'PY'
import datetime, json, os, sys
out, commit, setup, run, test, report, run_rc, test_rc, test_log, load_before, host, approx = sys.argv[1:]
summary = [line for line in open(test_log).read().splitlines() if " passed" in line or "FAILED" in line][-12:]
r = json.load(open(report)) if os.path.exists(report) else {}
passk = {c["k"]: [c["diff"], c["lo"], c["hi"]] for c in r.get("comparisons", [])}  # after - before
parts = {p["part"]: {d["k"]: [d["diff"], d["lo"], d["hi"]] for d in p["diffs"]} for p in r.get("parts", [])}
data = {
    "date": datetime.date.today().isoformat(), "commit": commit, "cores": os.cpu_count(),
    "loadavg_before": [float(x) for x in load_before.split()], "loadavg_after": os.getloadavg(), "setup_s": int(setup), "make_run_s": int(run), "make_test_s": int(test),
    "make_run_stage_s": r.get("timings", {}), "make_run_passk_diff": passk, "make_run_parts": parts,
    "host": json.loads(host), "approximation": approx == "1",
    "make_run_rc": int(run_rc), "make_test_rc": int(test_rc), "make_test_summary": summary,
}
json.dump(data, open(out, "w"), indent=1)
print(json.dumps(data, indent=1))
PY
# The table in docs/benchmarks.md, from every record (this one included); the clone's Python is 3.11.
(cd "$src" && "$work/leafe/.venv/bin/python" -m bench.readme_table)
exit $(( run_rc || test_rc ))
