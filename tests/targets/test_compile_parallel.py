"""compile --tp/--ep and meta (graph-only) artifacts: rank folders, manifest, hashes, refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from ernie_ir.backends.sessions import run_artifact
from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.mapping import Mapping
from ernie_ir.ir.parser import parse_graph
from ernie_ir.load import load_input
from ernie_ir.passes import run_pipeline
from ernie_ir.runtime.interpreter import run_graph
from ernie_ir.targets import CompileOptions, compile_model, load_rank_graphs, read_manifest, verify_artifact

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_testkit import tiny_config, write_paddle_checkpoint

IDS = np.array([[1, 5, 900, 77, 3, 1000, 12]])
MOE = "ernie-4.5-300b-a47b@tiny"


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("target", ["cuda", "ascend", "kunlun"])
def test_split_quantized_artifact_equals_the_unsplit_quantized_graph(tmp_path: Path, target: str) -> None:
    report = compile_model(MOE, target, CompileOptions(quant="wint8mix", tp=2, ep=2, out=tmp_path / "a",
                           cuda_arch=70 if target == "cuda" else 80))
    assert report.parallel == "world 2, tp 2, ep 2 (moe_tp 1)"
    manifest = verify_artifact(tmp_path / "a")
    layout = manifest.parallel
    assert (layout.tp, layout.ep, layout.world_size) == (2, 2, 2)
    assert Mapping.model_validate(layout.mapping) == Mapping.create(2, 2, num_experts=16, vocab_size=1024)
    for r in (0, 1):
        for name in ("graph.ir", "weights.safetensors"):
            assert manifest.rank_files[f"rank{r}"][name] == manifest.files[f"rank{r}/{name}"]
    quantized = load_input(MOE)
    run_pipeline(quantized, "wint8mix")
    ref = run_graph(quantized, {"input_ids": IDS})["logits"]
    got = run_artifact(tmp_path / "a", IDS, "interpreter")
    # legalization is exact where a kernel reads the weights (sm70 packs every layer here)
    assert rel(got, ref) < (1e-5 if target != "kunlun" else 5e-3)
    assert "onnxruntime" not in manifest.backends  # ONNX has no collectives


def test_rank_weights_open_with_safetensors_and_hold_the_rank_slices(tmp_path: Path) -> None:
    compile_model("ernie-4.5-0.3b@tiny", "ascend", CompileOptions(tp=2, out=tmp_path / "a"))
    graph = load_input("ernie-4.5-0.3b@tiny")
    name = "ernie.layers.1.mlp.down_proj.weight"  # row-parallel: rows cut in halves
    whole = graph.params[name].read()
    half = whole.shape[0] // 2
    for r in (0, 1):
        with safe_open(str(tmp_path / "a" / f"rank{r}" / "weights.safetensors"), "np") as f:
            keys = set(f.keys())
            assert name in keys and "ernie.layers.0.input_layernorm.weight" in keys
            got = f.get_tensor(name)
        assert np.array_equal(got.view(np.uint16), whole[r * half:(r + 1) * half].view(np.uint16))


def test_compile_refuses_layouts_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ErnieIRError, match="unsupported layout"):
        compile_model(MOE, "cuda", CompileOptions(tp=2, ep=4, out=tmp_path / "x"))
    with pytest.raises(ErnieIRError, match="no routed experts"):
        compile_model("gpt-345m@tiny", "cuda", CompileOptions(ep=2, out=tmp_path / "y"))
    with pytest.raises(ErnieIRError, match="QAT is trained on one rank"):
        compile_model("gpt-345m@tiny", "cuda", CompileOptions(quant="qat-int8", mode="training", tp=2,
                      out=tmp_path / "z"))
    with pytest.raises(ErnieIRError, match="both set the layout"):
        compile_model("gpt-345m@tiny", "cuda", CompileOptions(pipeline="split{tp=2}", tp=2,
                      out=tmp_path / "w"))
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_meta_model_compiles_to_a_graph_only_artifact(tmp_path: Path) -> None:
    report = compile_model("ernie-4.5-300b-a47b@meta", "cuda", CompileOptions(quant="wint8mix", lora_rank=8,
                           tp=8, out=tmp_path / "m"))
    assert any("graph-only artifact" in w for w in report.warnings)
    root = tmp_path / "m"
    manifest = verify_artifact(root)
    assert manifest.weights is False and manifest.backends == ["interpreter"]
    assert sorted(p.name for p in (root / "rank7").iterdir()) == ["graph.ir"]
    assert not list(root.rglob("*.safetensors")) and not (root / "inference" / "onnx").exists()
    for run in (lambda: run_artifact(root, IDS, "interpreter"), lambda: load_rank_graphs(root)):
        with pytest.raises(ErnieIRError, match="graph-only artifact"):
            run()
    # the rank graphs are the compiled ones: quantized, adapted, cut and legalized
    text = (root / "rank3" / "graph.ir").read_text()
    assert "all_reduce" in text and "lora" in text and "weight_only_linear_packed" in text


@pytest.mark.slow
def test_meta_300b_compiles_with_tp8_pp2_sp(tmp_path: Path) -> None:
    """The seeds' FP8 32K layout (tp 8 x pp 2 with sp) on the whole 300B graph: 16 stage rank
    graphs cut at layer 28 (ERNIEKit's [0, 29, 57] with the embedding counted as a layer)."""
    root = tmp_path / "m"
    report = compile_model("ernie-4.5-300b-a47b@meta", "cuda", CompileOptions(tp=8, sp=True, pp=2, out=root))
    assert "pp 2 (layers 0-27, 28-53" in report.parallel
    manifest = verify_artifact(root)
    assert manifest.parallel.pp == 2 and len(manifest.parallel.ranks) == 16
    assert manifest.parallel.mapping["stages"] == [[0, 28], [28, 54]]
    graphs = {r: parse_graph((root / f"rank{r}" / "graph.ir").read_text()) for r in (0, 8, 15)}
    first, last = graphs[0], graphs[15]
    assert [v.name for v in first.inputs] == ["input_ids"]
    assert [v.name for v in last.inputs] == ["input_ids", "act0"] and last.output_names == ["logits"]
    assert last.metadata["pipeline"]["rank_varying_inputs"] == ["act0"]  # a sequence shard
    assert first.metadata["parallel"]["rank"] == 0 and last.metadata["parallel"]["rank"] == 7
    # tensor rank 0's two stages hold its params between them, the tied embedding on both
    both = set(graphs[0].params) & set(graphs[8].params)
    assert both == {"ernie.embed_tokens.weight"}, both


def test_folder_read_with_meta_opens_no_weight_file(tmp_path: Path) -> None:
    cfg = tiny_config("ernie-4.5-0.3b")
    folder = tmp_path / "ckpt"
    write_paddle_checkpoint(folder, cfg)
    for f in folder.glob("*.safetensors"):
        f.write_bytes(b"not safetensors at all")  # --meta must not even open them
    report = compile_model(str(folder), "ascend", CompileOptions(quant="wint8", tp=2, meta=True,
                           out=tmp_path / "m"))
    manifest = read_manifest(report.out)
    assert manifest.weights is False
    assert list(manifest.source["files"]) == ["config.json"]
    with pytest.raises(ErnieIRError):
        load_input(str(folder))  # without --meta the damaged weights are refused
    json.loads((folder / "config.json").read_text())


def test_verify_refuses_a_file_that_resolves_outside_the_artifact(tmp_path: Path) -> None:
    compile_model("ernie-4.5-0.3b@tiny", "ascend", CompileOptions(out=tmp_path / "a"))
    outside = tmp_path / "elsewhere.ir"
    graph_ir = tmp_path / "a" / "rank0" / "graph.ir"
    outside.write_bytes(graph_ir.read_bytes())  # same bytes, so only the location can give it away
    graph_ir.unlink()
    graph_ir.symlink_to(outside)
    with pytest.raises(ErnieIRError, match="resolves outside the artifact"):
        verify_artifact(tmp_path / "a")
