"""Graph folders: graph.ir + weights.safetensors, saved atomically, reloaded bit-exactly."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ernie_ir  # noqa: F401  (registers the op set)
from ernie_ir.ir import DType, ErnieIRError, Graph, GraphBuilder, WeightError, tensor
from ernie_ir.ir.equality import structural_diff
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.storage import GRAPH_FILE, WEIGHTS_FILE, load_graph, save_graph
from ernie_ir.ir.weights import (
    ArraySource,
    SafetensorsSource,
    WeightSource,
    content_hash,
    write_safetensors,
)


def data(dtype: DType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == DType.BOOL:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype == DType.I4:
        return rng.integers(-8, 8, shape).astype(np.int8).astype(ml_dtypes.int4)
    if dtype.is_int:
        return rng.integers(0, 100, shape).astype(dtype.numpy)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)


def every_dtype_graph() -> Graph:
    """One param per dtype plus an odd-sized int4 one, each cast to f32 and combined with x."""
    b = GraphBuilder("store")
    x = b.input("x", tensor(DType.F32, "B", 3))
    acc = x
    for i, dtype in enumerate(DType):
        p = b.param(f"p.{dtype}", source=ArraySource(data(dtype, (1, 3), seed=i)),
                    trainable=i % 2 == 0, annotations={"i": i} if i % 3 == 0 else None)
        with b.scope(f"layer.{i}"):
            acc = b.add(acc, b.cast(p, dtype=DType.F32))
    odd = b.param("odd.i4", source=ArraySource(data(DType.I4, (7,), seed=99)))
    with b.scope("tail"):
        head, _rest = b.split(odd, axis=0, sizes=(3, 4))
        y = b.mul(acc, b.cast(b.reshape(head, shape=(1, 3)), dtype=DType.F32))
    b.output(y, name="y")
    b.graph.metadata = {"model": "store-test", "layers": len(DType)}
    return b.graph


def test_save_and_load_round_trip_every_dtype_bit_exactly(tmp_path):
    g = every_dtype_graph()
    folder = save_graph(g, tmp_path / "model")
    assert folder == tmp_path / "model"
    assert sorted(p.name for p in folder.iterdir()) == [GRAPH_FILE, WEIGHTS_FILE]
    assert (folder / GRAPH_FILE).read_text(encoding="utf-8") == print_graph(g)
    loaded = load_graph(folder)
    assert structural_diff(loaded, g) is None
    assert print_graph(loaded) == print_graph(g)
    assert set(loaded.params) == set(g.params) and len(loaded.params) == 12
    for name, p in g.params.items():
        q = loaded.params[name]
        assert isinstance(q.source, SafetensorsSource)
        got, want = q.read(), p.read()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), name


def test_a_reloaded_graph_saves_to_identical_bytes(tmp_path):
    g = every_dtype_graph()
    first = save_graph(g, tmp_path / "a")
    second = save_graph(load_graph(first), tmp_path / "b")
    for f in (GRAPH_FILE, WEIGHTS_FILE):
        assert (first / f).read_bytes() == (second / f).read_bytes()


def test_params_without_data_stay_without_data(tmp_path):
    b = GraphBuilder("meta")
    x = b.input("x", tensor(DType.F32, 4))
    w = b.param("w", tensor(DType.BF16, 4, 4))
    b.output(b.linear(x, w), name="y")
    loaded = load_graph(save_graph(b.graph, tmp_path / "m"))
    assert loaded.params["w"].source is None
    with pytest.raises(WeightError, match=r"param w has no data \(a meta graph\)"):
        loaded.params["w"].read()


def test_an_existing_folder_is_replaced_only_with_overwrite(tmp_path):
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "keep.txt").write_text("precious")
    with pytest.raises(ErnieIRError, match=r"model already exists \(pass overwrite=True / --force"):
        save_graph(every_dtype_graph(), dest)
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]
    save_graph(every_dtype_graph(), dest, overwrite=True)
    assert sorted(p.name for p in dest.iterdir()) == [GRAPH_FILE, WEIGHTS_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


class Exploding(WeightSource):
    """Declares a tensor, then fails when its bytes are needed (a disk error mid-save)."""

    def __init__(self) -> None:
        self.dtype, self.shape = DType.F32, (1, 3)

    def read(self) -> np.ndarray:
        raise OSError("disk on fire")

    def describe(self) -> str:
        return "exploding"


def graph_with_a_failing_param() -> Graph:
    """Two params; the first writes fine, the second fails while the file is half written."""
    b = GraphBuilder("fails")
    x = b.input("x", tensor(DType.F32, 1, 3))
    good = b.param("good", source=ArraySource(data(DType.F32, (1, 3), seed=0)))
    bad = b.param("bad", source=Exploding())
    b.output(b.add(b.add(x, good), bad), name="y")
    return b.graph


def test_a_failed_save_leaves_no_folder_and_no_temporary(tmp_path):
    with pytest.raises(OSError, match=r"disk on fire"):
        save_graph(graph_with_a_failing_param(), tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_overwrite_keeps_the_old_folder(tmp_path):
    dest = save_graph(every_dtype_graph(), tmp_path / "model")
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    with pytest.raises(OSError, match=r"disk on fire"):
        save_graph(graph_with_a_failing_param(), dest, overwrite=True)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def hashed_folder(tmp_path):
    g = every_dtype_graph()
    for p in g.params.values():
        p.digest = content_hash(p.read())
    folder = save_graph(g, tmp_path / "h")
    text = (folder / GRAPH_FILE).read_text(encoding="utf-8")
    assert text.count(' hash "') == len(g.params)
    assert text == print_graph(g, with_hashes=True)
    return g, folder


def test_hashes_in_the_text_are_checked_on_load(tmp_path):
    g, folder = hashed_folder(tmp_path)
    loaded = load_graph(folder)
    assert {n: p.digest for n, p in loaded.params.items()} == {n: p.digest for n, p in g.params.items()}


def test_a_hash_that_does_not_match_the_text_is_refused(tmp_path):
    g, folder = hashed_folder(tmp_path)
    digest = g.params["p.bf16"].digest
    path = folder / GRAPH_FILE
    path.write_text(path.read_text(encoding="utf-8").replace(digest, "0" * 16), encoding="utf-8")
    with pytest.raises(WeightError, match=r"param @p\.bf16: data does not match the hash in graph\.ir"):
        load_graph(folder)
    assert load_graph(folder, check_hashes=False).params["p.bf16"].digest == "0" * 16


def test_changed_weight_bytes_are_caught_by_the_hash(tmp_path):
    _g, folder = hashed_folder(tmp_path)
    weights = folder / WEIGHTS_FILE
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0x01  # last byte: the packed odd int4 param
    weights.write_bytes(bytes(raw))
    with pytest.raises(WeightError, match=r"param @odd\.i4: data does not match the hash"):
        load_graph(folder)


def test_loading_refuses_folders_without_text(tmp_path):
    with pytest.raises(ErnieIRError, match=r"is not a graph folder \(no graph\.ir\)"):
        load_graph(tmp_path)


def test_loading_refuses_weights_that_contradict_the_text(tmp_path):
    g = every_dtype_graph()
    folder = save_graph(g, tmp_path / "m")
    tensors = [(n, p.read()) for n, p in g.params.items()]
    wrong = [(n, a.reshape(3, 1) if n == "p.f32" else a) for n, a in tensors]
    write_safetensors(folder / WEIGHTS_FILE, wrong)
    with pytest.raises(WeightError, match=r"param p\.f32: declared f32\[1,3\] but its source "
                                          r"\(weights\.safetensors:p\.f32\) holds f32\[3, 1\]"):
        load_graph(folder)
    write_safetensors(folder / WEIGHTS_FILE, [*tensors, ("stray", np.zeros(2, np.float32))])
    with pytest.raises(WeightError, match=r"weights\.safetensors: tensor 'stray' is not a param"):
        load_graph(folder)
