"""Reference: PaddleNLP's own GPT pretraining dataset windows (paddlenlp.data.causal_dataset).

Runs in the ``nlp`` environment (paddlepaddle 3.3.1 + paddlenlp 3.0.0b4, which ships the
``fast_dataindex`` C++ helper its sample index uses). Never imports ernie_ir.

Usage::

    python nlp_pretrain_windows.py SPEC OUT_DIR

SPEC: ``prefix`` (required: PREFIX_ids.npy + PREFIX_idx.npz, the format PaddleNLP's old
``create_pretraining_data.py`` writes and its ``CompatibleIndexedDataset`` reads), ``cases``
(required): a list of ``{"seed", "seq_length", "split", "num_samples": [train, valid, test]}``.

The two files are copied into ``OUT_DIR/data/`` first: PaddleNLP writes its index cache
(``index-cache/``) beside the data it reads. Each case runs
``build_train_valid_test_datasets([prefix], "mmap", split, num_samples, seq_length, seed,
skip_warmup=True)`` with its own empty cache folder (``data_cache_path``), i.e. the library
builds doc_idx (numpy), the sample index (``fast_dataindex.helpers.build_sample_idx``) and the
shuffle index itself, then reads every window of each dataset in order (``dataset[i]["text"]``,
i = 0 .. len - 1).

Writes per case c and part p in (train, valid) whose dataset exists: ``c{c}_{p}.npy`` (int64
[len, seq_length + 1]: the windows in dataset order), ``c{c}_{p}_doc_idx.npy``,
``c{c}_{p}_sample_idx.npy``, ``c{c}_{p}_shuffle_idx.npy`` (the library's index arrays);
``meta.json``: per case the dataset lengths (null: no dataset), versions, timings.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path
from typing import Any

import _refcommon as rc
import numpy as np


def main() -> None:
    spec, out = rc.parse_args()
    rc.quiet_env()
    timer = rc.Timer()
    import paddlenlp
    from paddlenlp.data.causal_dataset import build_train_valid_test_datasets

    timer.lap("import")
    data = out / "data"
    data.mkdir(exist_ok=True)
    src = Path(spec["prefix"])
    for suffix in ("_ids.npy", "_idx.npz"):
        shutil.copyfile(f"{src}{suffix}", data / f"{src.name}{suffix}")
    prefix = str(data / src.name)
    cases: list[dict[str, Any]] = []
    for c, case in enumerate(spec["cases"]):
        cache = out / f"cache{c}"
        cache.mkdir(exist_ok=True)
        log = io.StringIO()
        with contextlib.redirect_stdout(log):  # the library prints its progress
            datasets = build_train_valid_test_datasets(
                [prefix], "mmap", case["split"], case["num_samples"], case["seq_length"], case["seed"],
                True, data_cache_path=str(cache))
        shutil.rmtree(data / "index-cache", ignore_errors=True)  # it looks there first next time
        lengths: dict[str, int | None] = {}
        for part, ds in zip(("train", "valid"), datasets[:2], strict=True):
            if ds is None:
                lengths[part] = None
                continue
            windows = np.stack([np.asarray(ds[i]["text"], np.int64) for i in range(len(ds))])
            np.save(out / f"c{c}_{part}.npy", windows)
            for name in ("doc_idx", "sample_idx", "shuffle_idx"):
                np.save(out / f"c{c}_{part}_{name}.npy", np.asarray(getattr(ds, name)))
            lengths[part] = len(ds)
        cases.append({**case, "lengths": lengths})
        timer.lap(f"case{c}")
    rc.write_meta(out, {"library": {"paddlenlp": paddlenlp.__version__}, "cases": cases,
                        "call": "paddlenlp.data.causal_dataset.build_train_valid_test_datasets",
                        "timing_s": timer.laps})


if __name__ == "__main__":
    main()
