#!/usr/bin/env bash
# What a change to the kernels or the wrapper must pass on a GPU, in one command:
#
#   tests/gpu_check.sh [STEP ...]     # steps: bench ab moe peers tune near retime_splits grid
#                                     #        grid_tree suite
#                                     #        sanitize demo
#                                     # (default: bench demo suite sanitize)
#
# * bench     python -m punica_numba bench, alone on the GPU (its times are the point)
# * ab        the benchmark at $BASE (a commit) and here, alternately, $ROUNDS times each,
#             then `bench --compare` of the two sides (ab.txt; exit 1 if a case is > 3 %
#             slower): a change against the code before it, on one machine in one hour
# * moe       python -m punica_numba bench --moe of each kernel version ($MOE_VERSIONS,
#             default all), alone on the GPU; with $VLLM_SRC (vLLM 0.33.0's extracted source
#             release) also docs/benchmarks/peers/vllm_moe_lora.py
# * peers     python -m punica_numba bench --peers: the layers the strongest peers were timed on
# * tune      python -m punica_numba tune $TUNE_ARGS (default --quick; at 0635975 its first 63
#             of 128 problems took 200 s on an H200: TUNE_ARGS="--quick --part 1/2") into
#             $OUT/configs (resumed if there), the table to copy into punica_numba/configs/
#             once it is whole; e.g. TUNE_ARGS="--hiddens 4096 --ranks 16,64,128 --dtypes
#             bf16 --part 1/2" for half of Llama-3-8B's layers, or TUNE_ARGS="--moe --quick" for
#             the MoE op's entries (96 problems, 78 s on an H200 at 9fd11ec)
# * retime_splits  python -m punica_numba tune --retime of every split configuration (the row
#             and the tensor-core splits) on a copy of this GPU's shipped table, in
#             $OUT/retime ($RETIME_ARGS added, e.g. "--ranks 16,32 --slices 1"): the split
#             times the table holds carry the fill of the counters that each captured call
#             made before 8e0a61b (kernels/shrink_split.py, "The workspace"), and no table
#             has timed the cluster forms (kernels/shrink_mma_split.py, "In one cluster");
#             the table to copy into punica_numba/configs/ if its picks should change
# * near      python -m punica_numba tune --near 8 --resume over a copy of this GPU's shipped
#             table, in $OUT/near ($NEAR_ARGS: its grid, default "--hiddens 4096": Llama-3-8B's
#             layers at every rank, both dtypes; the problems the table holds are skipped,
#             each other one timed under the picks of its 8 nearest entries and the
#             heuristic's: tuning/near.py), the table to copy into punica_numba/configs/
# * grid      python -m punica_numba bench --grid, the parts in $GRID_PARTS (default "1/3 2/3
#             3/3", about 4 minutes each: split them over calls of a 10-minute limit), one
#             JSON a part, to join with `bench --grid --merge`; $GRID_ARGS are added (e.g.
#             "--twins": every case in both dtypes, 3 parts of about 5 minutes)
# * grid_tree the same parts with the kernels of the package in $GRID_TREE (an older
#             commit's tree, $GRID_TREE_COMMIT: tests/grid_at_tree.py), one JSON a part, for
#             `bench --grid --merge ... --against`
# * demo      python -m punica_numba demo with --json and --plot, alone on the GPU
# * suite     the whole pytest suite under HYPOTHESIS_PROFILE=gpu
# * sanitize  tests/sanitize.sh, its four tools side by side
#
# Timed steps run first and one at a time; the two correctness steps then run side by side
# (they share the GPU; their results do not depend on its speed). Everything goes to
# $GPU_CHECK_OUT (default: a fresh temporary folder, printed at the end), one log a step,
# and the last line of each log is printed.
#
# Environment (all optional):
#   PYTHON          the interpreter (default: python3); PYTHONPATH is kept as given
#   GPU_CHECK_OUT   where logs, JSON and plots go
#   COMMIT          the commit the benchmark records (default: git HEAD, if there is one)
#   SUITE_WORKERS   pytest-xdist workers for the suite (default 4; 0: one process). Ten on an
#                   80 GB H100 ran out of memory at 36135c6 where the suite's last files ran
#                   together (test_ops' test of offsets past 2^31 holds 43 GB), and eight
#                   there at 323e302 in one test (test_wrapper's add_shrink; it passed alone)
#   SUITE_TESTS     the suite's pytest targets (default: tests). The whole gpu profile took
#                   over 10 minutes on an H200 with 8 workers (at 5d81db4), and 1,350 s on an
#                   H100 with 8 then 6 (323e302, three calls): run it in parts. The log ends
#                   with the 30 slowest tests' times, for a run to plan its parts by
#   SUITE_LIMIT     seconds after which the suite is interrupted (SIGINT: pytest then writes
#                   the failures so far, tracebacks and summary, into its log; killed 20 s
#                   later if it has not ended)
#   SUITE_DONE      the suite.log of an earlier run of the same commit: the tests it reports
#                   passed or skipped are left out (tests/suite_parts.py), so that a run
#                   a limit stopped is taken up where it stopped
#   SAN_WORKERS     pytest-xdist workers for each sanitizer tool (default 2)
#   BASE, ROUNDS    ab: the commit to compare with (required), rounds of each side (default 2)
#   BASE_TREE       ab: BASE's tree, extracted where git is (`git archive BASE punica_numba`),
#                   for a machine without the repository's history (else a git worktree)
#   VLLM_SRC        moe: vLLM 0.33.0's source release, extracted (vllm-0.33.0/, with vllm/ in it)
#   MOE_VERSIONS    moe: the versions to time, e.g. "6 8" (default: every one of the op's
#                   VERSIONS)
#   MOE_AGAINST     moe: a run to set each version's cases beside (bench --moe --against),
#                   e.g. docs/benchmarks/h200_moe_vllm_0.33.json on an H200
#   GRID_PARTS      grid, grid_tree: the parts to run (default "1/3 2/3 3/3")
#   GRID_ARGS       grid, grid_tree: more options of `bench --grid`, e.g. "--twins"
#   GRID_TREE, GRID_TREE_COMMIT  grid_tree: the older tree (holding punica_numba/), its commit
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
GIVEN_PYTHONPATH="${PYTHONPATH:-}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"
OUT="${GPU_CHECK_OUT:-$(mktemp -d -t gpu_check.XXXXXX)}"
mkdir -p "$OUT"
COMMIT="${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
if [ "$#" -gt 0 ]; then STEPS=" $* "; else STEPS=" bench demo suite sanitize "; fi
want() { [[ "$STEPS" == *" $1 "* ]]; }
status=0
start=$(date +%s)
note() { echo "[+$(( $(date +%s) - start )) s] $*"; }

if want bench; then
    "$PYTHON" -m punica_numba bench --commit "$COMMIT" --json "$OUT/bench.json" \
        --plot "$OUT/roofline.png" >"$OUT/bench.log" 2>&1 || status=1
    note "bench: $(tail -n 1 "$OUT/bench.log")"
fi
if want ab; then
    if [ -z "${BASE:-}" ]; then
        note "ab: set BASE to the commit to compare with"
        status=1
    else
        if [ -n "${BASE_TREE:-}" ]; then  # BASE's tree extracted already (no git here)
            base="$(cd "$BASE_TREE" && pwd)"
            : >"$OUT/ab.log"
        else
            base="$OUT/base_tree"
            git worktree add --detach "$base" "$BASE" >"$OUT/ab.log" 2>&1 || status=1
        fi
        old=() new=()
        for round in $(seq "${ROUNDS:-2}"); do
            sides=(base here)
            [ $((round % 2)) = 0 ] && sides=(here base)  # each side first in turn
            for side in "${sides[@]}"; do
                if [ "$side" = base ]; then
                    json="$OUT/ab_base_$round.json" && old+=("$json")
                    (cd "$base" && PYTHONPATH="${GIVEN_PYTHONPATH:+$GIVEN_PYTHONPATH:}$base" \
                        "$PYTHON" -m punica_numba bench --commit "$BASE" --json "$json") \
                        >>"$OUT/ab.log" 2>&1 || status=1
                else
                    json="$OUT/ab_here_$round.json" && new+=("$json")
                    "$PYTHON" -m punica_numba bench --commit "$COMMIT" --json "$json" \
                        >>"$OUT/ab.log" 2>&1 || status=1
                fi
            done
        done
        (IFS=,; "$PYTHON" -m punica_numba bench --compare "${old[*]}" "${new[*]}") \
            >"$OUT/ab.txt" 2>&1 || status=1
        [ -n "${BASE_TREE:-}" ] || git worktree remove --force "$base" >>"$OUT/ab.log" 2>&1
        note "ab: $(tail -n 1 "$OUT/ab.txt")"
    fi
fi
if want moe; then
    every=$("$PYTHON" -c "from punica_numba.ops.moe import VERSIONS; print(*VERSIONS)" 2>/dev/null)
    [ -n "${MOE_VERSIONS:-$every}" ] || { note "moe: the op's VERSIONS could not be read"; status=1; }
    against=()
    [ -n "${MOE_AGAINST:-}" ] && against=(--against "$MOE_AGAINST")
    for version in ${MOE_VERSIONS:-$every}; do
        "$PYTHON" -m punica_numba bench --moe --version "$version" --commit "$COMMIT" \
            "${against[@]}" --json "$OUT/moe_v$version.json" >"$OUT/moe_v$version.log" 2>&1 \
            || status=1
        note "moe, version $version: $(tail -n 1 "$OUT/moe_v$version.log")"
    done
    if [ -n "${VLLM_SRC:-}" ]; then
        "$PYTHON" docs/benchmarks/peers/vllm_moe_lora.py --vllm-src "$VLLM_SRC" \
            --json "$OUT/moe_vllm.json" >"$OUT/moe_vllm.log" 2>&1 || status=1
        note "moe, vLLM 0.33: $(tail -n 1 "$OUT/moe_vllm.log")"
    fi
fi
if want peers; then
    "$PYTHON" -m punica_numba bench --peers --commit "$COMMIT" --json "$OUT/peers.json" \
        >"$OUT/peers.log" 2>&1 || status=1
    note "peers: $(tail -n 1 "$OUT/peers.log")"
fi
if want tune; then
    resume=()
    [ -d "$OUT/configs" ] && resume=(--resume)
    read -r -a tune_args <<<"${TUNE_ARGS:---quick}"
    "$PYTHON" -m punica_numba tune "${tune_args[@]}" "${resume[@]}" --commit "$COMMIT" \
        --out "$OUT/configs" >"$OUT/tune.log" 2>&1 || status=1
    note "tune: $(tail -n 1 "$OUT/tune.log")"
fi
if want near; then
    mkdir -p "$OUT/near"
    table=$("$PYTHON" -c "from punica_numba.tuning.table import gpu_name, table_file_name
print(table_file_name(gpu_name()))")
    [ -f "$OUT/near/$table" ] || cp "punica_numba/configs/$table" "$OUT/near/" 2>/dev/null
    read -r -a near_args <<<"${NEAR_ARGS:---hiddens 4096}"
    "$PYTHON" -m punica_numba tune --near 8 --resume "${near_args[@]}" --commit "$COMMIT" \
        --out "$OUT/near" >"$OUT/near.log" 2>&1 || status=1
    note "near: $(tail -n 1 "$OUT/near.log")"
fi
if want retime_splits; then
    mkdir -p "$OUT/retime"
    table=$("$PYTHON" -c "from punica_numba.tuning.table import gpu_name, table_file_name
print(table_file_name(gpu_name()))")
    splits=$("$PYTHON" -c "from punica_numba.launch import config_name, launch_configs
print(','.join(config_name(c) for c in launch_configs('shrink') if c.kernel == 'split' or c.splits > 1))")
    if [ -f "punica_numba/configs/$table" ] && [ -n "$splits" ]; then
        [ -f "$OUT/retime/$table" ] || cp "punica_numba/configs/$table" "$OUT/retime/"
        read -r -a retime_args <<<"${RETIME_ARGS:-}"
        "$PYTHON" -m punica_numba tune --out "$OUT/retime" --retime "$splits" \
            "${retime_args[@]}" --commit "$COMMIT" >"$OUT/retime.log" 2>&1 || status=1
        note "retime_splits: $(tail -n 1 "$OUT/retime.log")"
    else
        note "retime_splits: no shipped table ($table) or no split configuration here"
        status=1
    fi
fi
read -r -a grid_args <<<"${GRID_ARGS:-}"
if want grid; then
    for part in ${GRID_PARTS:-1/3 2/3 3/3}; do
        name="grid_${part/\//of}"
        "$PYTHON" -m punica_numba bench --grid --part "$part" --commit "$COMMIT" \
            "${grid_args[@]}" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1 || status=1
        note "grid $part: $(tail -n 1 "$OUT/$name.log")"
    done
fi
if want grid_tree; then
    if [ -z "${GRID_TREE:-}" ] || [ -z "${GRID_TREE_COMMIT:-}" ]; then
        note "grid_tree: set GRID_TREE and GRID_TREE_COMMIT"
        status=1
    else
        for part in ${GRID_PARTS:-1/3 2/3 3/3}; do
            name="grid_tree_${part/\//of}"
            "$PYTHON" tests/grid_at_tree.py "$GRID_TREE" --commit "$GRID_TREE_COMMIT" \
                --harness "$COMMIT" --part "$part" "${grid_args[@]}" --json "$OUT/$name.json" \
                >"$OUT/$name.log" 2>&1 || status=1
            note "grid_tree $part: $(tail -n 1 "$OUT/$name.log")"
        done
    fi
fi
if want demo; then
    "$PYTHON" -m punica_numba demo --no-progress --json "$OUT/demo.json" \
        --plot "$OUT/demo.png" >"$OUT/demo.log" 2>&1 || status=1
    note "demo: $(tail -n 1 "$OUT/demo.log")"
fi
pids=()
if want suite; then
    workers=()
    [ "${SUITE_WORKERS:-4}" != 0 ] && workers=(-n "${SUITE_WORKERS:-4}")
    read -r -a targets <<<"${SUITE_TESTS:-tests}"
    done_before=()  # the tests an earlier log of this commit reports done (tests/suite_parts.py)
    [ -n "${SUITE_DONE:-}" ] && mapfile -t done_before < <("$PYTHON" tests/suite_parts.py "$SUITE_DONE")
    limit=()
    [ -n "${SUITE_LIMIT:-}" ] && limit=(timeout --signal=INT --kill-after=20 "$SUITE_LIMIT")
    HYPOTHESIS_PROFILE=gpu "${limit[@]}" "$PYTHON" -m pytest -v -rfE -p no:cacheprovider --durations=30 \
        "${workers[@]}" "${targets[@]}" "${done_before[@]}" >"$OUT/suite.log" 2>&1 &
    pids+=($!)
fi
if want sanitize; then
    for tool in memcheck racecheck initcheck synccheck; do
        SANITIZE_LOGS="$OUT/sanitize_$tool" SANITIZE_PYTEST_ARGS="-n ${SAN_WORKERS:-2}" \
            bash tests/sanitize.sh "$tool" >"$OUT/sanitize_$tool.txt" 2>&1 &
        pids+=($!)
    done
fi
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
if want suite; then note "suite: $(grep -E ' in [0-9.]+s' "$OUT/suite.log" | tail -n 1)"; fi
if want sanitize; then
    for tool in memcheck racecheck initcheck synccheck; do
        note "$(grep -E '^[a-z]+check: ' "$OUT/sanitize_$tool.txt" | tail -n 1)"
    done
fi
echo "logs: $OUT"
exit "$status"
