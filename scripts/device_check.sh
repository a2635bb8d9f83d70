#!/usr/bin/env bash
# Device check for a GPU machine: the cuda Paddle executable on the GPU against the interpreter.
#
#   bash scripts/device_check.sh [OUT_DIR]     (run from the repository root; about 1-3 minutes)
#
# Compiles ernie-4.5-21b-a3b@tiny and ernie-4.5-0.3b@tiny for --target cuda --quant wint8mix at the
# --cuda-arch of GPU 0, runs `ernie-ir run --backend paddle` (the Layer built from rank0/ on the GPU,
# Paddle's weight_only_linear with the packed weights) and `--backend interpreter`, and prints
# max abs / rel error and top-1 agreement. Needs paddlepaddle-gpu already installed (no network
# assumed); exit 2 when Paddle has no CUDA, 1 when a model disagrees.
set -euo pipefail
OUT=${1:-$(mktemp -d /tmp/ernie-ir-device-check.XXXXXX)}
PY=${PYTHON:-python}
if ! "$PY" -c "import paddle; assert paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0" \
    >/dev/null 2>&1; then
  echo "device_check: this Python's Paddle has no CUDA GPU: install paddlepaddle-gpu matching the CUDA driver (see https://www.paddlepaddle.org.cn/install) and rerun"
  exit 2
fi
ARCH=$("$PY" -c "from ernie_ir.backends.paddle.devices import cuda_arch; print(cuda_arch())")
echo "device_check: GPU arch sm$ARCH, artifacts in $OUT"
mkdir -p "$OUT"
"$PY" - <<'PYEOF' > "$OUT/tokens.txt"
import numpy as np
print(",".join(str(i) for i in np.random.default_rng(0).integers(1, 1000, size=16)))
PYEOF
TOKENS=$(cat "$OUT/tokens.txt")
STATUS=0
for MODEL in ernie-4.5-21b-a3b@tiny ernie-4.5-0.3b@tiny; do
  ART="$OUT/${MODEL//[@.]/_}"
  timeout 120 ernie-ir compile "$MODEL" --target cuda --quant wint8mix --cuda-arch "$ARCH" --out "$ART" --force >/dev/null
  timeout 60 ernie-ir run "$ART" --tokens "$TOKENS" --backend paddle --save-logits "$ART.paddle.npy" --json >/dev/null
  timeout 60 ernie-ir run "$ART" --tokens "$TOKENS" --backend interpreter --save-logits "$ART.interp.npy" --json >/dev/null
  "$PY" - "$MODEL" "$ART" <<'PYEOF' || STATUS=1
import sys
import numpy as np
from ernie_ir.backends.paddle.session import paddle_device_for
model, art = sys.argv[1], sys.argv[2]
dev = paddle_device_for(__import__("pathlib").Path(art))
a, b = np.load(art + ".paddle.npy"), np.load(art + ".interp.npy")
err = float(np.abs(a - b).max())
rel = err / max(float(np.abs(b).max()), 1e-30)
top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
print(f"{model}: paddle on {dev} vs interpreter: max_abs {err:.3e}  rel {rel:.3e}  top1 {top1:.3f}")
sys.exit(0 if dev.startswith("gpu") and rel < 5e-2 and top1 >= 0.9 else 1)
PYEOF
done
exit $STATUS
