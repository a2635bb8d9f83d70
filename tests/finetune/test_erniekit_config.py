"""ERNIEKit's training configs as they are (issue 39 item 1): `ernie-ir train CONFIG.yaml
key=value ...` compiles the model the config names into its output_dir and trains it there, as
`erniekit train CONFIG.yaml key=value ...` does.

ERNIEKit's published `run_sft_lora_8k.yaml`, `run_sft_8k.yaml` and `run_sft_wint8mix_lora_8k.yaml`
(ERNIE-4.5-0.3B) are quoted below verbatim and run unmodified except by overrides (the model path:
a random ERNIE 4.5 with a tokenizer written here; the data: a tiny ERNIEKit SFT file; output_dir;
max_steps=2). The refusals (an unknown key by name,
the hub id the published configs name, an existing output_dir, compute_type fp8) are one line,
exit 2, with nothing written. The overrides' typing (OmegaConf's dotlist rules) and the effective
values are checked against erniekit 1.3.0's own parser in test_erniekit_parser_agrees (reference).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from _cli_kit import run_cli as _run
from _fe_testkit import hf_to_paddle, random_hf_ernie, write_checkpoint
from test_tokenizer import ERNIE_TEMPLATE, train_sentencepiece

from ernie_ir.training.erniekit_config import (
    ErnieKitConfigError,
    config_values,
    erniekit_run,
    parse_override,
)
from ernie_ir.training.loop import TrainOptions

# https://github.com/PaddlePaddle/ERNIE/blob/535b840ee64fbb9ddf77b8cab197b4e59ea6f80d/examples/configs/ERNIE-4.5-0.3B/sft/run_sft_lora_8k.yaml
RUN_SFT_LORA_8K = """\
### data
train_dataset_type: "erniekit"
eval_dataset_type: "erniekit"
train_dataset_path: "./examples/data/sft-train.jsonl"
train_dataset_prob: "1.0"
eval_dataset_path: "./examples/data/sft-eval.jsonl"
eval_dataset_prob: "1.0"
max_seq_len: 8192

### model
model_name_or_path: baidu/ERNIE-4.5-0.3B-Paddle
fine_tuning: LoRA
lora_rank: 32
fuse_rope: True
use_sparse_head_and_loss_fn: True

### finetuning
# base
stage: SFT
seed: 23
do_train: True
do_eval: True
dataloader_num_workers: 1
batch_size: 1
num_train_epochs: 1
max_steps: -1
max_evaluate_steps: 10000
eval_steps: 100
evaluation_strategy: steps
save_steps: 100
save_strategy: steps
logging_steps: 1
release_grads: True
gradient_accumulation_steps: 8
logging_dir: ./vdl_log
output_dir: ./output
disable_tqdm: True

# train
warmup_steps: 20
learning_rate: 1.0e-4
lr_scheduler_type: cosine

# optimizer
weight_decay: 0.01
adam_epsilon: 1.0e-8
adam_beta1: 0.9
adam_beta2: 0.95
optim: adamw_custom
tensorwise_offload_optimizer: True

# performance
tensor_parallel_degree: 1
pipeline_parallel_degree: 1
sharding: stage1
pipeline_parallel_config: disable_partial_send_recv enable_clear_every_step_cache
recompute: False
recompute_use_reentrant: True
compute_type: bf16
fp16_opt_level: O2
disable_ckpt_quant: True
amp_master_grad: True
amp_custom_white_list:
  - lookup_table
  - lookup_table_v2
  - flash_attn
  - matmul
  - matmul_v2
  - fused_gemm_epilogue
amp_custom_black_list:
  - reduce_sum
  - softmax_with_cross_entropy
  - c_softmax_with_cross_entropy
  - elementwise_div
  - sin
  - cos
unified_checkpoint: True
unified_checkpoint_config: ignore_merge_optimizer
"""

# https://github.com/PaddlePaddle/ERNIE/blob/76fc87c6704776e14be6897cb09683cadfc97381/examples/configs/ERNIE-4.5-0.3B/sft/run_sft_8k.yaml
RUN_SFT_8K = """\
### data
train_dataset_type: "erniekit"
eval_dataset_type: "erniekit"
train_dataset_path: "./examples/data/sft-train.jsonl"
train_dataset_prob: "1.0"
eval_dataset_path: "./examples/data/sft-eval.jsonl"
eval_dataset_prob: "1.0"
max_seq_len: 8192

### model
model_name_or_path: baidu/ERNIE-4.5-0.3B-Paddle
fine_tuning: Full
fuse_rope: True
use_sparse_head_and_loss_fn: True

### finetuning
# base
stage: SFT
seed: 23
do_train: True
do_eval: True
dataloader_num_workers: 1
batch_size: 1
num_train_epochs: 1
max_steps: -1
max_evaluate_steps: 10000
eval_steps: 100
evaluation_strategy: steps
save_steps: 100
save_strategy: steps
logging_steps: 1
release_grads: True
gradient_accumulation_steps: 8
logging_dir: ./vdl_log
output_dir: ./output
disable_tqdm: True

# train
warmup_steps: 20
learning_rate: 1.0e-5
lr_scheduler_type: cosine

# optimizer
weight_decay: 0.1
adam_epsilon: 1.0e-8
adam_beta1: 0.9
adam_beta2: 0.95
optim: adamw_custom
tensorwise_offload_optimizer: True

# performance
tensor_parallel_degree: 1
pipeline_parallel_degree: 1
sharding: stage1
pipeline_parallel_config: enable_delay_scale_loss enable_release_grads disable_partial_send_recv
recompute: False
recompute_use_reentrant: True
compute_type: bf16
fp16_opt_level: O2
disable_ckpt_quant: True
amp_master_grad: True
amp_custom_white_list:
  - lookup_table
  - lookup_table_v2
  - flash_attn
  - matmul
  - matmul_v2
  - fused_gemm_epilogue
amp_custom_black_list:
  - reduce_sum
  - softmax_with_cross_entropy
  - c_softmax_with_cross_entropy
  - elementwise_div
  - sin
  - cos
unified_checkpoint: True
unified_checkpoint_config: ignore_merge_optimizer
"""

# https://github.com/PaddlePaddle/ERNIE/blob/886c22b08a24257af9d840f3fcbe2f65b2893b5a/examples/configs/ERNIE-4.5-0.3B/sft/run_sft_wint8mix_lora_8k.yaml
RUN_SFT_WINT8MIX_LORA_8K = """\
### data
train_dataset_type: "erniekit"
eval_dataset_type: "erniekit"
train_dataset_path: "./examples/data/sft-train.jsonl"
train_dataset_prob: "1.0"
eval_dataset_path: "./examples/data/sft-eval.jsonl"
eval_dataset_prob: "1.0"
max_seq_len: 8192
num_samples_each_epoch: 6000000

### model
model_name_or_path: baidu/ERNIE-4.5-0.3B-Paddle
fine_tuning: LoRA
lora_rank: 32
fuse_rope: True
use_sparse_head_and_loss_fn: True

### finetuning
# base
stage: SFT
seed: 23
do_train: True
do_eval: True
distributed_dataloader: False
dataloader_num_workers: 1
batch_size: 1
num_train_epochs: 1
max_steps: 100
max_evaluate_steps: 10000
eval_steps: 10000
evaluation_strategy: steps
save_steps: 10000000
save_total_limit: 5
save_strategy: steps
logging_steps: 1
release_grads: True
gradient_accumulation_steps: 8
logging_dir: ./vdl_log
output_dir: ./output
disable_tqdm: True

# train
warmup_steps: 20
learning_rate: 3.0e-4
lr_scheduler_type: cosine
min_lr: 0
layerwise_lr_decay_bound: 1.0

# optimizer
weight_decay: 0.01
adam_epsilon: 1.0e-8
adam_beta1: 0.9
adam_beta2: 0.95
offload_optim: True

# performance
tensor_parallel_degree: 1
pipeline_parallel_degree: 1
sharding_parallel_degree: 1
sharding: stage1
sequence_parallel: True
pipeline_parallel_config: disable_partial_send_recv enable_clear_every_step_cache
recompute: False
recompute_use_reentrant: True
fp16_opt_level: O2
disable_ckpt_quant: True
amp_master_grad: True
amp_custom_white_list:
  - lookup_table
  - lookup_table_v2
  - flash_attn
  - matmul
  - matmul_v2
  - fused_gemm_epilogue
amp_custom_black_list:
  - reduce_sum
  - softmax_with_cross_entropy
  - c_softmax_with_cross_entropy
  - elementwise_div
  - sin
  - cos
unified_checkpoint: True
unified_checkpoint_config: async_save
compute_type: wint4/8
"""

CFG = {
    "architectures": ["Ernie4_5_ForCausalLM"], "hidden_size": 48, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 448, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
SFT = [{"src": ["hello world"], "tgt": ["hi there"]}, {"src": "what is paddle", "tgt": "a framework"},
       {"system": "be brief", "src": ["one", "two"], "tgt": ["1", "2"]}]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random ERNIE 4.5 with a sentencepiece tokenizer and ERNIE's chat template, the SFT data
    and the published configs, written as ERNIEKit users have them."""
    root = tmp_path_factory.mktemp("erniekit")
    model = root / "ERNIE-4.5-0.3B-Paddle"
    write_checkpoint(model, CFG, hf_to_paddle(random_hf_ernie(CFG, seed=3), CFG))
    train_sentencepiece(model / "tokenizer.model", dummy_prefix=False)
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>",
        "unk_token": "<unk>", "cls_token": "<|begin_of_sentence|>", "sep_token": "<|end_of_sentence|>",
        "add_bos_token": False, "add_eos_token": False, "chat_template": ERNIE_TEMPLATE}))
    data = root / "sft-train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in SFT), encoding="utf-8")
    configs = {"lora": RUN_SFT_LORA_8K, "full": RUN_SFT_8K, "wint8mix": RUN_SFT_WINT8MIX_LORA_8K}
    for name, text in configs.items():
        (root / f"{name}.yaml").write_text(text, encoding="utf-8")
    return {"root": root, "model": model, "data": data, **{n: root / f"{n}.yaml" for n in configs}}


def _overrides(files: dict[str, Path], out: Path) -> list[str]:
    return [f"model_name_or_path={files['model']}", f"train_dataset_path={files['data']}",
            f"eval_dataset_path={files['data']}", f"output_dir={out}", "max_steps=2"]


EXPECT = {  # name -> lr, weight_decay, eval_steps, save_steps: the config's values, not the recipe's
    "lora": (1e-4, 0.01, 100, 100), "full": (1e-5, 0.1, 100, 100), "wint8mix": (3e-4, 0.01, 10000, 10000000)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPECT))
def test_published_sft_configs_compile_and_train(name: str, files: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("paddle")
    out = tmp_path / "output"
    code, stdout, stderr = _run("train", str(files[name]), *_overrides(files, out), "--json", "--no-progress")
    assert code == 0, stderr
    assert f"\ncompiled {files['model']} -> {out}" in stderr
    result = json.loads(stdout)
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])
    used = result["options"]
    lr, decay, eval_steps, save_steps = EXPECT[name]
    assert (used["lr"], used["weight_decay"], used["beta2"], used["seed"]) == (lr, decay, 0.95, 23)
    assert (used["warmup_steps"], used["schedule"]) == (20, "cosine")
    assert (used["grad_accum"], used["batch_size"]) == (8, 1)
    assert (used["eval_steps"], used["save_steps"], used["sharding"]) == (eval_steps, save_steps, None)
    assert [e[0] for e in result["eval_losses"]] == [2]  # eval_steps past max_steps: at the end only
    # output_dir is the artifact; its checkpoints are training/checkpoints/run-K-step-N
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["mode"] == "training"
    assert [Path(p).name for p in result["checkpoints"]] == ["run-001-step-2"]
    checkpoint = out / "training" / "checkpoints" / "run-001-step-2"
    assert (checkpoint / "adapter").is_dir() == (name != "full")
    assert ("wint8mix-erniekit" in json.dumps(manifest)) == (name == "wint8mix")  # compute_type wint4/8
    # every key is honoured or named, with its reason, as accepted without effect
    for key in ("fuse_rope", "amp_custom_white_list", "unified_checkpoint_config", "recompute"):
        assert f"note: {key}" in stderr and "accepted without effect" in stderr
    assert "note: sharding: stage1 over sharding_parallel_degree 1 shards nothing" in stderr
    if name == "full":  # the artifact in output_dir continues its run (ERNIEKit resumes there too)
        more = [a for a in _overrides(files, out) if a != "max_steps=2"]
        code, stdout, stderr = _run("train", str(files[name]), *more, "max_steps=3",
                                    "resume_from_checkpoint=true", "--json", "--no-progress")
        assert code == 0, stderr
        assert json.loads(stdout)["first_step"] == 3 and "\ncompiled " not in stderr


def _refused(argv: list[str], says: str, tmp_path: Path, before: set[str]) -> None:
    code, stdout, stderr = _run(*argv)
    lines = stderr.strip().splitlines()
    assert code == 2 and stdout == "" and lines[-1].startswith("error: "), stderr
    assert says in lines[-1], lines[-1]
    assert not any(line.startswith("error") for line in lines[:-1])
    assert {p.name for p in tmp_path.iterdir()} == before  # nothing written


@pytest.mark.slow
def test_refusals_are_one_line_and_write_nothing(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "output"
    base = ["train", str(files["lora"]), *_overrides(files, out)]
    _refused([*base, "fuse_ropee=True"], "unknown training option 'fuse_ropee' (did you mean fuse_rope?)",
             tmp_path, set())
    hub = [a for a in base if not a.startswith("model_name_or_path=")]
    _refused(hub, "'baidu/ERNIE-4.5-0.3B-Paddle' is a model hub id, and ernie-ir downloads nothing: download "
             "it, then add model_name_or_path=/path/to/folder", tmp_path, set())
    _refused([*base, "compute_type=fp8"], "compute_type fp8 trains with FP8 QAT (issue 37", tmp_path, set())
    _refused([*base, "train_dataset_type=chatml"], "train_dataset_type 'chatml'", tmp_path, set())
    _refused([*base, "max_steps"], "write key=value", tmp_path, set())
    missing = f"eval_dataset_path={tmp_path / 'none.jsonl'}"
    _refused([*base, missing], "none.jsonl does not exist", tmp_path, set())
    out.mkdir()
    _refused(base, f"output_dir {out} exists: add overwrite_output_dir=True (or --force)", tmp_path,
             {"output"})
    assert list(out.iterdir()) == []


def test_overrides_read_as_omegaconf_dotlist() -> None:
    """PyYAML reads `1e-5` as text; OmegaConf's loader (and erniekit's command line) as a float."""
    assert yaml.safe_load("1e-5") == "1e-5"
    assert parse_override("learning_rate=1e-5") == ("learning_rate", 1e-5)
    assert parse_override("max_steps=2") == ("max_steps", 2)
    assert parse_override("do_eval=false") == ("do_eval", False)
    assert parse_override("output_dir=2024-01-01") == ("output_dir", "2024-01-01")  # not a date
    assert parse_override("path=a=b") == ("path", "a=b")  # the first = splits
    assert parse_override("lora_path=") == ("lora_path", None)
    with pytest.raises(ErnieKitConfigError, match="nested key"):
        parse_override("a.b=1")


def test_what_erniekit_adjusts_is_adjusted_and_said(files: dict[str, Path]) -> None:
    run = erniekit_run(files["wint8mix"], [f"model_name_or_path={files['model']}", "output_dir=o"])
    # sequence_parallel at tp 1: off, as ERNIEKit's SFT workflow sets it; wint4/8: ERNIEKit's own rules
    assert any(n.startswith("sequence_parallel: tensor_parallel_degree is 1") for n in run.notes)
    assert run.compile == {"mode": "training", "quant": "wint8mix-erniekit", "lora_rank": 32, "tp": 1,
                           "pp": 1, "sp": False, "dp": 1, "sharding": None, "offload_optimizer": True}
    assert (run.steps, run.epochs) == (100, None)  # max_steps > 0 wins over num_train_epochs
    assert run.options["min_lr"] == 0 and run.options["save_total_limit"] == 5
    epochs = erniekit_run(files["lora"], [f"model_name_or_path={files['model']}", "output_dir=o"])
    assert (epochs.steps, epochs.epochs) == (None, 1.0)  # max_steps -1: num_train_epochs
    assert "quant" not in epochs.compile and "offload_optimizer" in epochs.compile


def test_train_config_reads_the_same_keys(files: dict[str, Path]) -> None:
    """`train ART --config` takes an ERNIEKit config too: its run's keys honoured, the compile
    keys named as the artifact's own."""
    run = config_values(yaml.safe_load(RUN_SFT_LORA_8K), "c.yaml")
    assert run.options["learning_rate"] == 1e-4 and run.options["gradient_accumulation_steps"] == 8
    assert "sharding" not in run.options and run.model is None and (run.steps, run.epochs) == (None, 1.0)
    assert any(n.startswith("model_name_or_path, fine_tuning, lora_rank") and "the artifact's own" in n
               for n in run.notes)
    assert config_values({"learning_rate": 0.5}, "c.yaml").steps is None  # no length: --steps decides


def test_min_lr_is_the_cosine_floor() -> None:
    opts = TrainOptions(lr=1.0, min_lr=0.1, schedule="cosine", warmup_steps=0)
    assert opts.lr_at(10, 10) == pytest.approx(0.1) and opts.lr_at(5, 10) == pytest.approx(0.55)
    assert TrainOptions(lr=1.0, min_lr=0.1, schedule="linear").lr_at(10, 10) == 0.0  # PaddleFormers' rule


REFENV = Path(os.environ.get("ERNIE_IR_REFENVS", Path.home() / ".cache" / "ernie-ir" / "refenvs"))
ERNIEKIT = REFENV / "erniekit"
"""erniekit 1.3.0 and the paddleformers 0.3.1 it pins, unpacked from their wheels (install_envs.sh
erniekit), run with the pf environment's Python (paddle, omegaconf)."""

PROBE = r"""
import json, sys
sys.argv = ["erniekit", "train", *sys.argv[1:]]
from erniekit.hparams.parser import get_train_args
model, data, _, _, tuning = get_train_args()
got = {k: getattr(model, k)
       for k in ("model_name_or_path", "lora", "lora_rank", "use_sparse_head_and_loss_fn")}
got.update({k: getattr(data, k) for k in ("train_dataset_path", "eval_dataset_path", "max_seq_len")})
got.update({k: getattr(tuning, k) for k in (
    "max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
    "learning_rate", "min_lr", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "max_grad_norm", "seed", "save_steps", "save_total_limit", "eval_steps", "output_dir",
    "overwrite_output_dir", "sequence_parallel", "compute_type")})
got["lr_scheduler_type"] = str(getattr(tuning.lr_scheduler_type, "value", tuning.lr_scheduler_type))
print("EFFECTIVE " + json.dumps(got))
"""


@pytest.mark.slow
@pytest.mark.reference
def test_erniekit_parser_agrees(files: dict[str, Path], tmp_path: Path) -> None:
    """erniekit 1.3.0's own parser, given the same YAML and overrides, reads the same values."""
    python = REFENV / "pf" / "bin" / "python"
    if not (ERNIEKIT / "erniekit").is_dir() or not python.is_file():
        pytest.skip("erniekit reference environment not built (tests/reference/install_envs.sh erniekit)")
    overrides = [*_overrides(files, tmp_path / "o"), "learning_rate=3e-4", "lr_scheduler_type=linear",
                 "min_lr=1e-6", "overwrite_output_dir=true", "sequence_parallel=true"]
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(ERNIEKIT)}
    done = subprocess.run([str(python), str(probe), str(files["wint8mix"]), *overrides], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    kit = json.loads(done.stdout.split("EFFECTIVE ", 1)[1].splitlines()[0])
    ours = erniekit_run(files["wint8mix"], overrides)
    used = TrainOptions.model_validate(ours.options)
    assert (ours.model, ours.output_dir, ours.overwrite) == (
        Path(kit["model_name_or_path"]), Path(kit["output_dir"]), kit["overwrite_output_dir"])
    assert (ours.data, ours.eval_data) == (Path(kit["train_dataset_path"]), Path(kit["eval_dataset_path"]))
    assert ours.max_seq_len == kit["max_seq_len"] and ours.steps == kit["max_steps"] == 2
    assert ours.compile["lora_rank"] == kit["lora_rank"] and kit["lora"] is True
    assert (used.lr, used.min_lr, used.schedule) == (kit["learning_rate"], kit["min_lr"],
                                                     kit["lr_scheduler_type"])
    assert (used.batch_size, used.grad_accum) == (kit["per_device_train_batch_size"],
                                                  kit["gradient_accumulation_steps"])
    assert (used.weight_decay, used.beta1, used.beta2, used.eps, used.clip_norm, used.seed) == (
        kit["weight_decay"], kit["adam_beta1"], kit["adam_beta2"], kit["adam_epsilon"], kit["max_grad_norm"],
        kit["seed"])
    assert (used.save_steps, used.save_total_limit, used.eval_steps, used.warmup_steps) == (
        kit["save_steps"], kit["save_total_limit"], kit["eval_steps"], 20)
    assert used.vocab_parallel_loss == kit["use_sparse_head_and_loss_fn"]
    # tp 1: erniekit's SFT workflow turns sequence_parallel off after parsing; its parser keeps it
    assert kit["sequence_parallel"] is True and ours.compile["sp"] is False
