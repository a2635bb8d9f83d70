#!/usr/bin/env bash
# Runs every reference script on its default spec and on the variants the test
# suite relies on, into a temporary folder, and prints one line per run:
#   ok|FAIL  <seconds>  <env>/<script> <spec>
# Needs the envs from install_envs.sh ($ERNIE_IR_REFENVS, default /work/refenvs).
# Exits 1 if any run fails (scripts themselves exit non-zero on non-finite logits, and
# with "generate" when the library's generate was not incremental greedy decoding).
set -u
ROOT="${ERNIE_IR_REFENVS:-/work/refenvs}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
bad=0 i=0
run() {  # run ENV SCRIPT SPEC
  local env="$1" script="$2" spec="$3" t0 t1 out
  i=$((i + 1)); out="$tmp/$i"
  t0=$(date +%s.%N)
  if PYTHONWARNINGS=ignore "$ROOT/$env/bin/python" "$HERE/$script" "$spec" "$out" >"$out.log" 2>&1; then
    t1=$(date +%s.%N); printf 'ok    %5.2fs  %s/%s %s\n' "$(echo "$t1 - $t0" | bc)" "$env" "$script" "$spec"
  else
    t1=$(date +%s.%N); printf 'FAIL  %5.2fs  %s/%s %s: %s\n' "$(echo "$t1 - $t0" | bc)" "$env" "$script" "$spec" "$(tail -n 1 "$out.log")"
    bad=1
  fi
}
run pf pf_ernie_dense.py '{}'
run pf pf_ernie_dense.py '{"num_key_value_heads": 4}'
run pf pf_ernie_dense.py '{"tie_word_embeddings": true}'
run pf pf_ernie_dense.py '{"hidden_size": 48, "num_hidden_layers": 3, "num_key_value_heads": 1, "head_dim": 16}'
run pf pf_lora.py '{}'
LORA="$tmp/$i"  # its base/ and adapter/ (paddleformers' own save) for pf_lora_load.py below
run pf pf_lora.py '{"num_key_value_heads": 4, "r": 8, "lora_alpha": 16}'
run pf pf_lora_load.py '{}'
run pf pf_lora_load.py '{"model": "moe"}'
run pf pf_lora_load.py "{\"base\": \"$LORA/base\", \"adapter\": \"$LORA/adapter\"}"
run pf pf_quant.py '{}'
run hf hf_ernie_dense.py '{}'
run hf hf_ernie_dense.py '{"num_key_value_heads": 4, "tie_word_embeddings": true}'
run hf hf_ernie_moe.py '{}'
run hf hf_ernie_moe.py '{"tie_word_embeddings": true, "moe_num_shared_experts": 0, "moe_layer_start_index": 0, "moe_layer_interval": 2, "moe_k": 3}'
run nlp nlp_gpt.py '{}'
run nlp nlp_gpt.py '{"fuse_attention_qkv": true, "num_hidden_layers": 3}'
# full-parameter training steps (spec key "batches"; writes losses.json and trained.npz)
TRAIN='"batches": [{"input_ids": [[5, 6, 7, 8, 9], [9, 10, 11, 12, 13]], "labels": [[-100, -100, 7, 8, 9], [9, 10, 11, 12, 13]]}, {"input_ids": [[15, 16, 17, 18, 19], [3, 4, 5, 6, 7]]}], "weight_decay": 0.1'
run pf pf_full_train.py "{$TRAIN}"
FULL="$tmp/$i"  # its ckpt/ (paddleformers' save), trained again by transformers below
run hf hf_full_train.py "{\"load_from\": \"$FULL/ckpt\", $TRAIN}"
run hf hf_full_train.py "{\"model\": \"moe\", $TRAIN}"
# greedy generate (spec key "generate"; writes generated.json)
GEN='"generate": {"prompts": [[87], [28, 32, 23], [27, 66, 101, 29, 31, 21, 0, 63]], "max_new_tokens": 12}'
run pf pf_ernie_dense.py "{$GEN}"
run hf hf_ernie_dense.py "{$GEN}"
run hf hf_ernie_moe.py "{$GEN}"
run nlp nlp_gpt.py "{$GEN}"
exit $bad
