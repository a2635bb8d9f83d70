"""The whole fine-tune-to-serve loop (issue 22), run as a user runs it, on a dense and a MoE
ERNIE 4.5 with a tokenizer trained in the test:

    ernie-ir compile BASE --mode training --lora-rank 4 --lora-alpha 8 --tp 2 --target cuda
    ernie-ir train ART --data sft.jsonl --eval-data sft.jsonl --eval-steps 2 --max-seq-len 64
    paddleformers LoRAModel.from_pretrained(BASE model, ART/training/checkpoints/run-1-step-3/adapter)
    ernie-ir compile BASE --lora-adapter CKPT --merge-lora --quant wint8mix --target cuda --tp 2
    ernie-ir export BASE --lora-adapter CKPT ; ernie-ir compile MERGED --quant wint8mix ... --tp 2

Checked: the adapter paddleformers loads equals the trained checkpoint (every value bit for
bit) and gives paddleformers' logits equal to ours (dense; its MoE forward has no CPU kernel,
so for MoE its merged weights W + A @ B * scaling are compared); the trained adapter changed
the model; the FastDeploy checkpoint of the merged compile equals, file by file and tensor by
tensor, the one compiled from the exported merged float checkpoint (quantizing the merged
weights directly), and the merged weights equal W + A @ B * scale computed here in numpy.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from _fe_testkit import run_reference
from test_tokenizer import ERNIE_TEMPLATE, train_sentencepiece

from ernie_ir.artifacts import verify_artifact
from ernie_ir.cli.app import main
from ernie_ir.formats.paddleformers_adapter import read_adapter
from ernie_ir.ir.weights import SafetensorsFile
from ernie_ir.load import load_input
from ernie_ir.passes import run_pipeline
from ernie_ir.runtime.interpreter import run_graph

pytestmark = [pytest.mark.gloo, pytest.mark.reference, pytest.mark.slow]

VOCAB = 448
CHATS = [
    {"src": "hello world", "tgt": "hi there"},
    {"system": "Be brief.", "src": ["the quick fox", "why?"], "tgt": ["jumps over the lazy dog", "because"],
     "label": [0, 1]},
    {"src": ["graph compile", "run tensor"], "tgt": ["model inference", "quantization works"]},
    {"instruction": "Translate: ", "input": "hello", "output": "你好"},
]


def _base(root: Path, model: str) -> Path:
    """paddleformers' save_pretrained of a random ERNIE 4.5 (dense or MoE) plus a tokenizer."""
    # widths whose tp 2 slices have Paddle's packed sm80 layout (multiples of 64), as FastDeploy needs
    sizes = {"head_dim": 32, "intermediate_size": 128}
    if model == "moe":
        sizes["moe_intermediate_size"] = 128
    run_reference("pf", "pf_lora_load.py", {"model": model, "vocab_size": VOCAB, "forward": False, **sizes},
                  root / "base_run")
    base = root / "base"
    shutil.copytree(root / "base_run" / "base", base)
    train_sentencepiece(base / "tokenizer.model", dummy_prefix=False)
    (base / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>",
        "unk_token": "<unk>", "cls_token": "<|begin_of_sentence|>", "sep_token": "<|end_of_sentence|>",
        "add_bos_token": False, "add_eos_token": False, "chat_template": ERNIE_TEMPLATE}))
    return base


def _ok(*argv: str) -> str:
    """`ernie-ir ARGV` in this process (module-scoped fixtures have no capsys): its stdout."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
        except SystemExit as e:
            assert e.code in (0, None), err.getvalue()
    return out.getvalue()


@pytest.fixture(scope="module", params=["dense", "moe"])
def loop(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Compile for training at tp 2, train 3 steps on SFT text; the run's paths and report."""
    root = tmp_path_factory.mktemp(f"loop-{request.param}")
    base = _base(root, request.param)
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in CHATS), encoding="utf-8")
    art = root / "art"
    _ok("compile", str(base), "--target", "cuda", "--mode", "training", "--lora-rank", "4",
        "--lora-alpha", "8", "--tp", "2", "--out", str(art))
    report = json.loads(_ok("train", str(art), "--steps", "3", "--data", str(data), "--eval-data",
                            str(data), "--eval-steps", "2", "--max-seq-len", "64", "--batch-size", "2",
                            "--lr", "5e-2", "--json"))
    return {"kind": request.param, "root": root, "base": base, "art": art, "report": report,
            "checkpoint": Path(report["checkpoints"][-1])}


def _logits(graph, ids: np.ndarray) -> np.ndarray:
    return np.asarray(run_graph(graph, {"input_ids": ids})["logits"], dtype=np.float32)


def _value(graph, name: str) -> np.ndarray:
    return np.asarray(graph.params[name].source.read())


def test_training_on_sft_text_learns_and_evaluates(loop: dict) -> None:
    report = loop["report"]
    assert len(report["losses"]) == 3 and all(np.isfinite(report["losses"]))
    assert [s for s, _ in report["eval_losses"]] == [2, 3]
    assert report["eval_losses"][-1][1] < report["eval_losses"][0][1] + 1.0  # finite, same scale
    assert (loop["checkpoint"] / "adapter" / "lora_config.json").is_file()
    listed = verify_artifact(loop["art"]).files  # every file checked, the adapter's listed
    assert any(n.endswith("adapter/lora_config.json") for n in listed)


def test_paddleformers_loads_the_trained_adapter(loop: dict) -> None:
    adapter = loop["checkpoint"] / "adapter"
    spec = {"base": str(loop["base"]), "adapter": str(adapter), "forward": loop["kind"] == "dense",
            "input_ids": [[5, 17, 33, 2, 90, 301, 7], [1, 2, 3, 4, 5, 6, 7]]}
    run = run_reference("pf", "pf_lora_load.py", spec, loop["root"] / "pf_load")
    meta = json.loads((run / "meta.json").read_text())
    assert meta["keys_not_in_file"] == [] and meta["file_keys_not_loaded"] == []
    assert meta["values_differ_from_file"] == []

    # the adapter is the trained checkpoint, bit for bit, and training moved B off zero
    ours = load_input(str(loop["base"]))
    run_pipeline(ours, f'lora-import{{path="{adapter}"}}', adapter_reader=read_adapter)
    trained = SafetensorsFile(loop["checkpoint"] / "params.safetensors")
    names = [n for n in trained if ".lora_" in n]
    assert names
    for n in names:
        assert _value(ours, n).tobytes() == trained.read(n).tobytes(), n
    assert max(float(np.abs(trained.read(n)).max()) for n in names if n.endswith("lora_B")) > 0

    if loop["kind"] == "dense":
        ids = np.load(run / "input_ids.npy")
        ref, ref_base = np.load(run / "logits.npy"), np.load(run / "base_logits.npy")
        assert np.abs(ref - ref_base).max() > 1e-3  # the trained adapter matters: the check can fail
        got = _logits(ours, ids)
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        print(f"\n[loop dense] paddleformers logits with our trained adapter: max rel {err:.2e}")
        assert err < 5e-5
    else:
        merged_pf = SafetensorsFile(run / "merged_state.safetensors")
        run_pipeline(ours, "lora-merge")
        expert = next(k for k in merged_pf if ".experts." in k and "up_gate_proj" in k)
        layer, e = expert.split(".layers.")[1].split(".")[0], int(expert.split(".experts.")[1].split(".")[0])
        stack = _value(ours, f"ernie.layers.{layer}.mlp.experts.up_gate_proj.weight")
        np.testing.assert_allclose(stack[e], merged_pf.read(expert), rtol=0, atol=1e-6)


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.rglob("*.safetensors")):
        st = SafetensorsFile(f)
        out.update({f"{f.relative_to(folder)}:{n}": st.read(n) for n in st})
    return out


def test_merged_deploy_equals_quantizing_the_merged_weights(loop: dict) -> None:
    root, base, ckpt = loop["root"], loop["base"], loop["checkpoint"]
    deploy, merged, direct = root / "deploy", root / "merged", root / "direct"
    # MoE: one rank, the bf16 folder FastDeploy quantizes at load (it loads no pre-quantized
    # weight-only expert, and quantizes a bf16 folder per rank)
    tp = "1" if loop["kind"] == "moe" else "2"
    _ok("compile", str(base), "--lora-adapter", str(ckpt), "--merge-lora", "--quant", "wint8mix",
        "--target", "cuda", "--tp", tp, "--emit", "fastdeploy", "--out", str(deploy))
    _ok("export", str(base), "--lora-adapter", str(ckpt), "--out", str(merged))
    _ok("compile", str(merged), "--quant", "wint8mix", "--target", "cuda", "--tp", tp, "--emit",
        "fastdeploy", "--out", str(direct))
    from ernie_ir.formats.fastdeploy import load_fastdeploy_checkpoint

    got, want = _tensors(deploy), _tensors(direct)
    assert set(got) == set(want) and any(f"rank{int(tp) - 1}" in k for k in got)
    for k in got:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    load_fastdeploy_checkpoint(deploy)  # FastDeploy's reading of the folder accepts it

    # the merged float weights are W + A @ B * scale, rounded once, as numpy computes it here
    import safetensors.numpy as stn

    weights = stn.load_file(str(merged / "model.safetensors"))
    base_graph = load_input(str(base))
    trained = SafetensorsFile(ckpt / "params.safetensors")
    scale = 8 / 4
    name = "ernie.layers.0.self_attn.o_proj"
    w = _value(base_graph, f"{name}.weight").astype(np.float32)
    want_w = w + (trained.read(f"{name}.lora_A").astype(np.float32)
                  @ trained.read(f"{name}.lora_B").astype(np.float32)) * np.float32(scale)
    assert np.array_equal(weights[f"{name}.weight"], want_w.astype(weights[f"{name}.weight"].dtype))
