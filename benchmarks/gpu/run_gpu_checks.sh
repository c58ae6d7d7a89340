#!/usr/bin/env bash
# spmd-nccl GPU checks: every check that needs a GPU, as one script (about 3-5 minutes on one GPU;
# under 10 on eight). Run it from anywhere on a Linux machine with NVIDIA GPUs and this repository:
#
#     bash benchmarks/gpu/run_gpu_checks.sh                 # results in $OUT, else ./gpu_results
#     bash benchmarks/gpu/run_gpu_checks.sh --max-bytes 268435456 --skip-conformance   # quicker
#
# What it runs (benchmarks/gpu/run_gpu_checks.py, checks in plugins/nccl/spmd_nccl/gpu_checks.py):
#   1. conformance on the GPU, world size 1 (and, with several GPUs, every GPU, three group shapes):
#      spmd's conformance cases on CUDA tensors through spmd.all_reduce & co on NCCL; the pairs
#      NCCL cannot reduce must raise UnsupportedReduction;
#   2. GPU behaviour: wait() orders the caller's stream without blocking the CPU, is_completed()
#      follows the CUDA event; full sub-groups come from ncclCommSplit; (2+ GPUs) a timeout aborts;
#   3. an all_reduce sweep, 4 B to 1 GiB: spmd vs torch.distributed's own NCCL process group vs the
#      bare ncclAllReduce through ctypes, with the spmd/torch ratio per size;
#   4. a CUDA-graph capture of spmd.all_reduce (replayed, checked, timed against eager).
# It writes report.md, report.json and log.txt.
#
# What it needs — nothing from the network:
#   * python3 with a CUDA build of torch that sees the GPU, plus pluggy and numpy. The image of
#     this workplace's H200 machines has them (torch 2.11+cu130 with nvidia-nccl-cu13); spmd-nccl
#     then binds the NCCL that torch itself uses (found in that wheel's nvidia/nccl/lib).
#   * Elsewhere, bring wheels and point WHEELS at the folder; they are installed, offline, into
#     .venv-gpu:   pip download -d wheels 'torch==2.13.*' --index-url https://download.pytorch.org/whl/cu128
#                  pip download -d wheels nvidia-nccl-cu12 pluggy numpy
#     (a cu12x torch build depends on nvidia-nccl-cu12 itself, so torch and spmd-nccl share one NCCL)
#   * spmd, spmd-gloo and spmd-nccl come from this checkout: installed ones are used if present,
#     else they are put on PYTHONPATH with their entry points declared in a throw-away folder
#     (no pip, no build step).
# Set SPMD_NCCL_LIBRARY=/path/libnccl.so.2 to test another NCCL.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

if [ -n "${WHEELS:-}" ]; then
    "$PY" -m venv .venv-gpu
    PY="$PWD/.venv-gpu/bin/python"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" torch nvidia-nccl-cu12 pluggy numpy
fi

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "run_gpu_checks: $PY has no CUDA torch that sees a GPU; read this script's header" >&2
    exit 2
fi

# spmd and its two plugins, importable with their entry points, without installing anything.
export PYTHONPATH="$PWD/core:$PWD/plugins/gloo:$PWD/plugins/nccl${PYTHONPATH:+:$PYTHONPATH}"
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
"$PY" - "$SHIM" <<'EOF'
import importlib.metadata, os, sys
shim = sys.argv[1]
dists = {  # distribution -> (import package, entry points)
    "spmd": ("spmd", ""),
    "spmd-gloo": ("spmd_gloo", "[spmd]\ngloo = spmd_gloo\n"),
    "spmd-nccl": ("spmd_nccl", "[spmd]\nnccl = spmd_nccl\n"),
}
for dist, (package, entry_points) in dists.items():
    try:
        importlib.metadata.distribution(dist)
        continue  # installed (pip install -e): use it as it is
    except importlib.metadata.PackageNotFoundError:
        pass
    info = os.path.join(shim, f"{dist.replace('-', '_')}-0.1.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(entry_points)
    print(f"run_gpu_checks: {dist} from this checkout (not installed)")
EOF
export PYTHONPATH="$PYTHONPATH:$SHIM"

set +e
timeout 570 "$PY" benchmarks/gpu/run_gpu_checks.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
set -e
[ "$status" = 124 ] && echo "run_gpu_checks: stopped at the 570 s limit" | tee -a "$OUT/log.txt"
exit "$status"
