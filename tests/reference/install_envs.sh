#!/usr/bin/env bash
# Creates the reference virtual environments used by tests/reference/*.py.
#
#   bash tests/reference/install_envs.sh [pf] [hf] [nlp] [fd] [erniekit]    (default: all five)
#
# Root: $ERNIE_IR_REFENVS (default /work/refenvs). Each env is $ROOT/<name>,
# made with `python3.11 -m venv`. Idempotent: an env whose smoke import passes
# is left alone; a broken or partial one is removed and rebuilt. Versions are
# pinned by the top-level requirements below plus constraints/<name>.txt (a
# pip freeze of a working env). Prints one "env <name>: ..." line per env with
# the seconds it took; exits non-zero if an env still fails its smoke import.
set -euo pipefail

ROOT="${ERNIE_IR_REFENVS:-/work/refenvs}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${ERNIE_IR_REFENVS_PYTHON:-python3.11}"

# top-level requirements, one env per line
req_pf=("paddlepaddle==3.3.1" "paddleformers==1.2.0" "pyarrow==25.*")
req_hf=("torch==2.13.0" "transformers==5.24.0" "safetensors==0.8.0")
req_nlp=("paddlepaddle==3.3.1" "paddlenlp==3.0.0b4" "aistudio-sdk<0.3" "pyarrow==25.*")

# smoke imports: the env "works" when this exits 0
smoke_pf='import paddle, paddleformers, pyarrow, datasets, safetensors
from paddleformers.transformers import Ernie4_5ForCausalLM
from paddleformers.peft import LoRAModel, LoRAConfig
assert paddle.__version__ == "3.3.1", paddle.__version__'
smoke_hf='import torch, transformers, safetensors
from transformers import Ernie4_5ForCausalLM, Ernie4_5_MoeForCausalLM
assert torch.__version__.startswith("2.13.0"), torch.__version__'
smoke_nlp='import paddle, paddlenlp, safetensors
from paddlenlp.transformers import GPTForCausalLM
assert paddlenlp.__version__ == "3.0.0b4", paddlenlp.__version__'

works() {  # works NAME
  local py="$ROOT/$1/bin/python" code="smoke_$1"
  [ -x "$py" ] && PYTHONWARNINGS=ignore "$py" -c "${!code}" >/dev/null 2>&1
}

build() {  # build NAME
  local name="$1" t0 req
  t0=$(date +%s)
  if works "$name"; then
    echo "env $name: ok (already works) $ROOT/$name"
    return 0
  fi
  rm -rf "${ROOT:?}/$name"
  mkdir -p "$ROOT"
  "$PY" -m venv "$ROOT/$name"
  req="req_${name}[@]"
  "$ROOT/$name/bin/python" -m pip install --quiet --disable-pip-version-check \
    -c "$HERE/constraints/$name.txt" "${!req}" 2>&1 | grep -v "is ignored: it is neither" || true
  if works "$name"; then
    echo "env $name: installed in $(( $(date +%s) - t0 ))s $ROOT/$name"
  else
    echo "env $name: FAILED smoke import after $(( $(date +%s) - t0 ))s" >&2
    return 1
  fi
}

# fd: FastDeploy's own loading code on a CPU (tests/reference/fd_load_check.py drives it), built by
# ../shared/fastdeploy/setup.sh from the FastDeploy source shipped there (2 GB: triton alone is 1 GB),
# into $ROOT/fd/{src,venv}; left alone once its smoke import passes (setup.sh itself always rebuilds).
SHARED_FD="${ERNIE_IR_SHARED_FASTDEPLOY:-$HERE/../../../shared/fastdeploy}"
smoke_fd="import sys; sys.argv = ['fd_load_check.py', '--help']
import importlib.util
spec = importlib.util.spec_from_file_location('fd_load_check', '$HERE/fd_load_check.py')
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
m.install_stubs('$ROOT/fd/src', 1, 0)
from fastdeploy.model_executor.model_loader import get_model_loader
import paddle; assert paddle.__version__ == '3.3.1', paddle.__version__"

build_fd() {
  local t0 py="$ROOT/fd/venv/bin/python"
  t0=$(date +%s)
  # FastDeploy's modules write a log/ folder into the working folder: theirs, not the checkout's
  if [ -x "$py" ] && (cd "$ROOT/fd" && PYTHONWARNINGS=ignore "$py" -c "$smoke_fd") >/dev/null 2>&1; then
    echo "env fd: ok (already works) $ROOT/fd"
    return 0
  fi
  if [ ! -f "$SHARED_FD/setup.sh" ]; then
    echo "env fd: skipped: no $SHARED_FD/setup.sh (the FastDeploy loader check needs ../shared/fastdeploy)"
    return 0
  fi
  mkdir -p "$ROOT/fd"
  (cd "$ROOT/fd" && PYTHON="$PY" bash "$SHARED_FD/setup.sh" "$ROOT/fd/src" "$ROOT/fd/venv" 2>&1 \
    | grep -v "is ignored: it is neither") || true
  if [ -x "$py" ] && (cd "$ROOT/fd" && PYTHONWARNINGS=ignore "$py" -c "$smoke_fd") >/dev/null 2>&1; then
    echo "env fd: installed in $(( $(date +%s) - t0 ))s $ROOT/fd"
  else
    echo "env fd: FAILED smoke import after $(( $(date +%s) - t0 ))s" >&2
    return 1
  fi
}

# erniekit: erniekit 1.3.0's argument parser (tests/finetune/test_erniekit_config.py) with the
# paddleformers 0.3.1 it pins, both unpacked from their wheels (no dependencies) into $ROOT/erniekit
# and run by the pf env's Python (paddle, omegaconf) with PYTHONPATH=$ROOT/erniekit; needs pf.
smoke_erniekit='from erniekit.hparams.parser import get_train_args
import paddleformers; assert paddleformers.__version__ == "0.3.1", paddleformers.__version__'

build_erniekit() {
  local t0 py="$ROOT/pf/bin/python" dir="$ROOT/erniekit" wheel
  t0=$(date +%s)
  works pf || build pf || return 1
  if (cd "$ROOT" && PYTHONPATH="$dir" PYTHONWARNINGS=ignore "$py" -c "$smoke_erniekit") >/dev/null 2>&1; then
    echo "env erniekit: ok (already works) $dir"
    return 0
  fi
  rm -rf "${dir:?}" && mkdir -p "$dir/wheels"
  "$py" -m pip download --quiet --disable-pip-version-check --no-deps -d "$dir/wheels" \
    "erniekit==1.3.0" "paddleformers==0.3.1"
  for wheel in "$dir"/wheels/*.whl; do "$py" -m zipfile -e "$wheel" "$dir"; done
  if (cd "$ROOT" && PYTHONPATH="$dir" PYTHONWARNINGS=ignore "$py" -c "$smoke_erniekit") >/dev/null 2>&1; then
    echo "env erniekit: installed in $(( $(date +%s) - t0 ))s $dir"
  else
    echo "env erniekit: FAILED smoke import after $(( $(date +%s) - t0 ))s" >&2
    return 1
  fi
}

names=("$@")
[ ${#names[@]} -eq 0 ] && names=(pf hf nlp fd erniekit)
status=0
for n in "${names[@]}"; do
  case "$n" in
    pf|hf|nlp) build "$n" || status=1 ;;
    fd) build_fd || status=1 ;;
    erniekit) build_erniekit || status=1 ;;
    *) echo "unknown env: $n (choose pf, hf, nlp, fd, erniekit)" >&2; status=2 ;;
  esac
done
exit $status
