#!/usr/bin/env bash
# Everything lmcache-pd checks and measures on a GPU, in one go, on a bare CUDA machine that has
# torch, Triton, pytest and Python 3.12 but no vLLM and no network (the lent GPU machines).
#
# NIXL, msgspec and pyzmq travel as cp312 wheels in .whl/ (see README, "On a GPU"); the C block
# copy is built in place. Writes its logs and JSON under $1 (default: ./gpu-results):
#   pytest.log           the kernel, layout and worker-half tests on CUDA tensors (real NIXL)
#   kernels_gpu.json     benchmarks/kernels_gpu.py: Triton copies vs a device copy, cold L2
#   load_stall_gpu.json  benchmarks/load_stall_gpu.py: what a load adds to the model's step
#   transfer_gpu.json    benchmarks/transfer_gpu.py: producer to consumer through NIXL, both buffers
#   gpu.json             benchmarks/gpu_summary.py: the three against issue 34's goals
#
#   bash benchmarks/gpu_session.sh "$OUT"
set -uo pipefail
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/lmcache-pd-site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/lmcache-pd-site:$PWD
# kernels/ and proxy/ install as lmcache_pd.kernels and lmcache_pd.proxy (setup.py); uninstalled,
# links make them importable from the checkout.
ln -sfn ../kernels lmcache_pd/kernels && ln -sfn ../proxy lmcache_pd/proxy
nvidia-smi -L
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
python3 setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }

timeout 300 python3 -m pytest -q -p no:cacheprovider --maxfail=10 \
    tests/test_kernels.py tests/test_gpu_layouts.py 2>&1 | tee "$out/pytest.log" | tail -25
timeout 300 python3 -m benchmarks.kernels --device cuda --models big --runs 30 \
    ${KERNEL_SWEEP:---sweep} --output "$out/kernels_gpu.json" 2>&1 | grep -v " INFO " | tail -40
timeout 120 python3 -m benchmarks.load_stall_gpu --runs 15 \
    --output "$out/load_stall_gpu.json" 2>&1 | tail -8
timeout 240 python3 -m benchmarks.transfer_gpu --runs 5 \
    --output "$out/transfer_gpu.json" 2>&1 | grep -E "benchmarks.transfer_gpu|Error|error" | tail -12
python3 -m benchmarks.gpu_summary "$out" 2>&1 | tail -1
