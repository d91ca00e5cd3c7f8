#!/usr/bin/env bash
# Run the GPU kernel and wrapper tests under each compute-sanitizer tool.
#
#   tests/sanitize.sh                      # memcheck, racecheck, initcheck, synccheck
#   tests/sanitize.sh memcheck racecheck   # only these
#
# Prints one line per tool, "memcheck: 0 errors" etc. (from the sanitizer's "ERROR
# SUMMARY", or racecheck's "RACECHECK SUMMARY", summed over the processes it watched),
# and exits non-zero if any tool reports an error, if the tests fail under it, or if it
# printed no summary at all.
# Full logs go to $SANITIZE_LOGS (default: a fresh temporary folder, printed at the end).
#
# Environment (all optional):
#   PYTHON              the interpreter (default: python3); PYTHONPATH is kept as given
#   COMPUTE_SANITIZER   the sanitizer binary (default: compute-sanitizer on PATH, else
#                       /usr/local/cuda/bin/compute-sanitizer)
#   HYPOTHESIS_PROFILE  default sanitize: 3 examples per property, small shapes (under
#                       racecheck one test of test_ops takes several seconds on an H200)
#   SANITIZE_TESTS      the pytest targets (default below; the >2**31-element tests are
#                       left out: 6 GiB tensors under memcheck take too long)
#   SANITIZE_PYTEST_ARGS  more pytest arguments (e.g. "-n 3" to spread the tests over
#                       pytest-xdist workers; --target-processes all watches every one)
#   SANITIZE_KERNELS    memcheck, racecheck and synccheck check only kernels whose names
#                       contain one of these words (default "shrink expand": the library's
#                       kernels are shrink, expand and expand_tiled); "all" checks every
#                       kernel, the tests' own torch kernels (random inputs, references)
#                       too, many times slower. initcheck always checks every kernel (below)
#
# Notes:
# * PYTORCH_NO_CUDA_MEMORY_CACHING=1: every torch tensor gets its own cudaMalloc, so
#   memcheck sees the true end of each buffer (a caching allocator hands out pieces of
#   larger blocks, and a read past a tensor's end would land inside the block unseen).
#   It also makes initcheck see fresh, uninitialised memory for every torch.empty.
# * --report-api-errors no: cuda-bindings probes the driver with cuGetProcAddress for
#   entry points it may lack, and each probe's CUDA_ERROR_INVALID_VALUE would count as
#   an error; the kernels' memory accesses are what is checked here.
# * The CUDA-graph test is left out: without torch's caching allocator (above) every
#   allocation is a cudaMalloc, which a stream capture does not allow.
# * initcheck runs unfiltered: it learns which bytes are initialised only from the
#   kernels it instruments, so with a filter every write by torch's own kernels is
#   unseen, and torch's later copies of those tensors are reported as reads of
#   uninitialised memory (100 such reports over test_ops alone on an H200). It is the
#   slowest tool unfiltered: test_ops, test_edge_cases and test_wrapper took 446 s.
# * racecheck first runs tests/planted_race.py, a kernel with a planted race, under the
#   same options and filter, and must report it; otherwise the run fails (a filter that
#   matched nothing would report "0 errors" for kernels it never checked).
# * racecheck checks shared memory: the shrink's sums across warps (a tree on the
#   simulator) and the tiled expand's staged chunks; --racecheck-report all prints both
#   the hazards and racecheck's analysis of them. It is the slowest tool: at the
#   sanitize profile, test_ops and the launch tests of test_determinism took 155 s on
#   an H200.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-sanitize}"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1

PYTHON="${PYTHON:-python3}"
SANITIZER="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
LOGS="${SANITIZE_LOGS:-$(mktemp -d -t sanitize.XXXXXX)}"
mkdir -p "$LOGS"

if [ "$#" -gt 0 ]; then TOOLS=("$@"); else TOOLS=(memcheck racecheck initcheck synccheck); fi

if [ -n "${SANITIZE_TESTS:-}" ]; then
    read -r -a TESTS <<<"$SANITIZE_TESTS"
else
    TESTS=()
    for f in tests/test_ops.py tests/test_wrapper.py tests/test_edge_cases.py tests/test_moe.py; do
        [ -e "$f" ] && TESTS+=("$f")
    done
fi

if [ ! -x "$SANITIZER" ] && ! command -v "$SANITIZER" >/dev/null; then
    echo "sanitize.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
    exit 2
fi

filter=()
if [ "${SANITIZE_KERNELS:-shrink expand}" != all ]; then
    for word in ${SANITIZE_KERNELS:-shrink expand}; do filter+=(--kernel-name "kns=$word"); done
fi

status=0
for tool in "${TOOLS[@]}"; do
    case "$tool" in
        memcheck) extra=(--leak-check no) ;;
        racecheck) extra=(--racecheck-report all) ;;
        initcheck) extra=() ;;  # and no filter: see the notes above
        synccheck) extra=() ;;
        *) echo "sanitize.sh: unknown tool $tool" >&2; exit 2 ;;
    esac
    log="$LOGS/$tool.log"
    rm -f "$log"
    if [ "$tool" = racecheck ]; then
        control="$LOGS/racecheck.control.log"
        "$SANITIZER" --tool racecheck --report-api-errors no "${extra[@]}" "${filter[@]}" \
            --log-file "$control" "$PYTHON" tests/planted_race.py >/dev/null 2>&1
        found=$(sed -nE 's/.*RACECHECK SUMMARY: .*\(([0-9]+) errors?.*/\1/p' "$control" | head -n 1)
        if [ "${found:-0}" -lt 1 ]; then
            echo "racecheck: did not report the planted race of tests/planted_race.py (see $control)"
            status=1
            continue
        fi
        echo "racecheck: found the planted race ($found error(s)), as it must"
    fi
    only=("${filter[@]}")
    [ "$tool" = initcheck ] && only=()
    "$SANITIZER" --tool "$tool" --target-processes all --report-api-errors no "${extra[@]}" "${only[@]}" \
        --log-file "$log" \
        "$PYTHON" -m pytest -q -x -p no:cacheprovider ${SANITIZE_PYTEST_ARGS:-} "${TESTS[@]}" \
        -k 'not offsets_past and not cuda_graph' \
        >"$LOGS/$tool.pytest.txt" 2>&1
    pytest_rc=$?
    result=$(grep -E ' in [0-9.]+s' "$LOGS/$tool.pytest.txt" | tail -n 1)

    # memcheck, initcheck, synccheck end with "========= ERROR SUMMARY: 3 errors";
    # racecheck with "RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)".
    # One summary per process watched: add them up.
    if [ "$tool" = racecheck ]; then
        counts=$(sed -nE 's/.*RACECHECK SUMMARY: .*\(([0-9]+) errors?, ([0-9]+) warnings?\).*/\1 \2/p' \
            "$log" 2>/dev/null)
    else
        counts=$(sed -nE 's/.*ERROR SUMMARY: ([0-9]+) errors?.*/\1 0/p' "$log" 2>/dev/null)
    fi
    if [ -z "$counts" ]; then
        echo "$tool: no summary from the sanitizer (see $log and $LOGS/$tool.pytest.txt)"
        status=1
        continue
    fi
    read -r errors warnings < <(awk '{ e += $1; w += $2 } END { print e + 0, w + 0 }' <<<"$counts")
    line="$tool: $errors errors"
    [ "$tool" = racecheck ] && line+=" ($warnings warnings)"
    echo "$line; pytest: ${result:-no result, exit code $pytest_rc}"
    if [ "$errors" -ne 0 ] || [ "$pytest_rc" -ne 0 ]; then
        status=1
    fi
done
echo "logs: $LOGS"
exit "$status"
