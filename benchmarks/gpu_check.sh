#!/usr/bin/env bash
# What a session lent one GPU runs, in one go (docs/gpu.md): the CUDA path check, then float8
# training under Piper (rowwise scaling, TorchTitan's default, then tensorwise).
#
#   bash benchmarks/gpu_check.sh OUT_DIR [TORCHAO_WHEEL_DIR ...]
#
# The GPU machine runs its own torch and installs nothing from a registry: torchao comes as
# wheels (one folder per version, tried in order; the first whose float8 layer trains on this
# GPU is used). The two links stand in for `pip install -e .`'s mapping of recipes/ and adapters/.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [TORCHAO_WHEEL_DIR ...]}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NVIDIA_TF32_OVERRIDE=0
ln -sfn ../recipes piper_plugin/recipes && ln -sfn ../adapters piper_plugin/adapters
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
site=""
for wheels in "$@"; do
  dir=/tmp/site_$(basename "$wheels")
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$dir" "$wheels"/*.whl || continue
  if PYTHONPATH=$dir python3 -c "
import torch, torchao
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
m = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(64, 64)).cuda(),
                               config=Float8LinearConfig.from_recipe_name('rowwise'))
m(torch.randn(32, 64, device='cuda')).sum().backward()
print('torchao', torchao.__version__, 'float8 trains on', torch.cuda.get_device_name(0), 'with torch', torch.__version__)
" 2>&1 | tail -3 | tee -a "$out/gpu.txt" | grep -q "float8 trains"; then site=$dir; break; fi
done
export PYTHONPATH=.${site:+:$site}
status=0
timeout 210 python3 -m benchmarks.cuda_check --out "$out/cuda_check.md" > "$out/cuda_check.log" 2>&1 || status=1
tail -25 "$out/cuda_check.log"
if [ -n "$site" ]; then
  timeout 150 python3 -m benchmarks.float8_check --out "$out/float8_check.md" > "$out/float8_check.log" 2>&1 || status=1
  tail -12 "$out/float8_check.log"
  timeout 100 python3 -m benchmarks.float8_check --recipe tensorwise --cases "1f1b 1 rank" "zb-h1 1 rank, BW stream" \
      --out "$out/float8_tensorwise.md" > "$out/float8_tensorwise.log" 2>&1 || status=1
  tail -6 "$out/float8_tensorwise.log"
else
  echo "float8 check not run: no torchao wheel trains float8 here" | tee -a "$out/gpu.txt"; status=1
fi
exit $status
