#!/usr/bin/env bash
# verl 0.9.1 for the verl facade's tests (tests/integrations/verl), beside the active environment:
# every package pinned and installed with --no-deps into one directory (default .verl-site/ in the
# repository), so pip never resolves anything (never a CUDA torch) and the environment is unchanged.
# The tests find it there; elsewhere put it on PYTHONPATH.
#
#   bash scripts/install_verl_test_env.sh [TARGET]
#
# Needs what `bash scripts/setup.sh` installs (torch CPU, tensordict, ray, TransferQueue 0.1.11,
# omegaconf). Each package is one verl 0.9.1 imports at module level on the way to
# verl.trainer.ppo.v1 (transformers via verl.protocol; peft/accelerate via fsdp_utils; datasets
# via the loss utils; fastapi/uvicorn/cachetools via the rollout server modules); anyio is held
# at 4.12.1 because 4.13 needs a newer typing_extensions than torch's; kernels is held at 0.12.3, the
# range transformers 5.10.4 supports (a newer one beside, e.g. from `dataplane[hf]`, breaks its import).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:-.verl-site}
PY=${PYTHON:-$(command -v python || command -v python3)}
if [[ -f "$TARGET/verl/__init__.py" ]] && grep -q '0.9.1' "$TARGET"/verl-0.9.1.dist-info/METADATA 2>/dev/null \
  && [[ -d "$TARGET/kernels-0.12.3.dist-info" ]]; then
  echo "verl 0.9.1 already in $TARGET"; exit 0
fi
"$PY" -m pip install -q --no-deps --disable-pip-version-check --target "$TARGET" \
  verl==0.9.1 \
  transformers==5.10.4 huggingface-hub==1.33.0 tokenizers==0.22.2 safetensors==0.8.0 kernels==0.12.3 \
  httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.12.1 \
  codetiming==1.4.0 torchdata==0.11.0 peft==0.21.2 accelerate==1.15.0 \
  cachetools==8.0.2 uvicorn==0.54.0 fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 \
  datasets==5.2.0 pandas==3.1.1 pyarrow==26.0.1 multiprocess==0.70.19 dill==0.4.1 xxhash==4.1.0
# the verl wheel ships top-level `tests` and `scripts` packages, which would shadow a project's own
rm -rf "$TARGET/tests" "$TARGET/scripts"
echo "verl 0.9.1 installed in $TARGET"
