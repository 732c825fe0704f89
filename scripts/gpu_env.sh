# Source on the GPU machine (device tool): installs the carried wheels (.whl/) and points SpecPilot at the carried
# datasets (.data/datasets). Converted models live in /tmp/models (see BENCHMARKS.md, "device procedure").
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
export PYTHONPATH=/tmp/site:$PWD SPECPILOT_DATASETS=$PWD/.data/datasets PYTHONUNBUFFERED=1
export SPECPILOT_CACHE=/tmp/specpilot-cache
mkdir -p /tmp/runs /tmp/ship
# The device machines keep NVLink multicast off (device KINDS.md): keep it so for torchrun's NCCL ranks too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Autotuning results kept on disk (Triton's cache dir) and reused by the next process on this machine: every
# process of a session (bench, each profile, validation inside training) re-timed every config of every fused
# kernel at each new shape (session 19: the 0.5B profile ran past 150 s; a step-timing variant's setup took 90 s
# the first time in a process, 2 s after). Same configs chosen, so the same numbers across a session's processes.
export TRITON_CACHE_AUTOTUNING=1
# ... and carried between sessions (scripts/triton_cache.sh): an earlier session's results, if .tcache/ is carried
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
bash scripts/triton_cache.sh seed || true
