"""Greedy generation with a KV cache (issue 20): decode speed of every backend against
transformers' and paddleformers' `generate` and against the machine's memory bandwidth, one run.

The model: ERNIE-4.5-0.3B at its published widths (hidden 1024, 16 query / 2 kv heads, head dim
128, intermediate 3072, vocabulary 103424, tied embeddings, rope theta 500000, eps 1e-5) with
--layers layers: default 6, NOT the published 18, to keep one run near three minutes on two
cores. With 6 layers the float32 tied head (424 MB) is 55% of the float32 bytes a decode step
reads and 83% of the wint8mix bytes (no preset quantizes the head). Seeded weights: every matrix
N(0, 1/fan_in) (the embedding table too), norm weights 1 + 0.1 N(0,1), written as one
transformers-layout float32 safetensors folder that all three libraries load. Batch 1, a
--prompt-tokens (32) token prompt, --new-tokens (64) new tokens, greedy, EOS ignored.

Ours: the folder compiled for cuda three times (`compile_model`): float32 (`emit="onnx,paddle"`),
wint8mix with `onnx_numerics="fast"` and wint8mix `"weight-only"`, each generating through
`ernie_ir.generation.Generator`: interpreter (float32 artifact), onnxruntime (the three ONNX
decoders, onnxruntime's default session), paddle (the float32 artifact's Paddle Layer).
References, in the same run, as subprocesses of the reference environments ($ERNIE_IR_REFENVS,
else /work/refenvs, else ~/.cache/ernie-ir/refenvs; envs `hf` and `pf`, tests/reference/README.md)
running benchmarks/_generate_ref.py (which does not import ernie_ir): transformers `generate`
(torch CPU float32, use_cache=True) and paddleformers `generate` (greedy_search with
`past_key_values=DynamicCache(config=model.config)`, explicit position ids and mask, eos -1:
REFERENCE.md 9.4), both loaded once and checked to decode incrementally (the prompt, then one
token per forward). Everyone gets --threads (2) threads. Only one generator runs at a time.

Two measurements, each with the generators taking turns (the order rotates):
A. `generate`, --rounds (3) times each: tokens/s = new tokens / wall of the whole call (prefill
   included, as a user sees it); xtr / xpa: that over transformers' / paddleformers' in the same
   round, median over rounds. The generated tokens are compared too (leading tokens equal).
B. single decode steps on a fixed past: each generator prefills the 32-token prompt and a
   --long-context (1024) token prompt once, then in each of --reps (10) reps runs --warm (2)
   untimed steps (the first steps after another generator ran are 10-30 ms slower: caches) and
   --block (3) timed one-token steps on each past (the past is not extended: every step reads
   exactly 32 or 1024 cached positions; the references crop their DynamicCache back). step@N is
   the median; ratio = step@1024 / step@32 within each rep, median over reps (goal 1); xtrst:
   transformers' step@32 over this one's, per rep.
C. prefill (issue 41): each generator prefills the --long-context prompt --prefill-reps (3)
   times, taking turns (the order rotates); pre@1024 is the median, xtrpre / xpapre the
   reference's time over this one's, per rep, median (>= 1: as fast or faster). Both sides compute
   the logits of every position (the reference's forward is called without logits_to_keep).
The physical limit: weight bytes read per step / copy bandwidth. Bytes: every initializer of the
ONNX file once (float32 4 B/param; int8 1 B + scales; the tied table once, for the head; a table
only gathered from would count one row); the interpreter, Paddle and the references read the
float32 weights and get the float32 count. Bandwidth: `np.copyto` between two --copy-mib (1024)
MiB float32 buffers (the VM reports a 300 MiB L3), counted read + written (STREAM's copy
convention), measured before, during (two copies per rep of B) and after; xlim = step@32 / limit,
per rep. This limit is not a hard floor: np.copyto is one thread writing as much as it reads,
while a step's two threads only read, so a step can beat it (xlim < 1).
Last, an onnxruntime profile (ms per operator type, per decode step after --warm untimed ones)
of the float32 and wint8mix-fast decoders at both contexts, and what grows between them.

Goals (issue 20): (1) flat: step@1024 <= 1.3 x step@32 for every backend of ours; (2) tokens/s:
ONNX float32 >= 1.5x transformers', ONNX wint8mix fast >= 2.5x; (3) ONNX float32 and wint8mix
fast decode steps <= 2.0x the bandwidth limit. Issue 41: (4) prefill of 1024 tokens, ONNX float32
and the default wint8mix (weight-only) each <= 1.0x transformers' time in the same run.

Measured (2026-12-01, 2 cores, defaults: 6 layers, 195 s; copy bandwidth 18.5 GB/s; weight MB
per step: float32 763, wint8mix fast 511, weight-only 514; ms):

    generator                 pre@32 pre@1024 step@32 step@1024 ratio tok/s  xtr  xtrst  xlim
    interpreter                  187     3463    39.1      47.2  1.15 23.20 1.04   1.05  0.99
    onnx float32                 130     2463    34.8      35.8  1.06 25.85 1.13   1.21  0.87
    onnx wint8mix fast           119     2633    23.8      25.9  1.07 35.83 1.41   1.76  0.91
    onnx wint8mix weight-only    171     4139    30.0      33.1  1.07 24.91 1.14   1.36  1.17
    paddle float32               178     7937    40.6      48.1  1.19 24.10 0.97   1.01  1.05
    transformers                  67     2490    41.0      44.3  1.10 26.08 1.00   1.00  1.09
    paddleformers                134     6113    45.5      77.2  1.71 22.04 0.88   0.90  1.17

The float32 generators give the 64 tokens transformers and paddleformers give; the wint8mix ones
their first 5 (then their own). Goals: (1) met by every backend (ratio 1.06-1.19). Before the
GQA attention grouped its query heads onto the kv heads (emit_onnx / paddle_layer
`attention`), it copied the 2 kv heads out to 16 every layer and step (an `Expand` in ONNX,
`repeat_interleave` in Paddle): ratios 1.44-1.64, the profile's Expand +7 to +9 ms at 1024; and
the graph outputs were Identity copies of the cache (+1.1 to +1.5 ms). (2) missed: ONNX float32
is 1.13x transformers' tokens/s (1.21x per decode step) and wint8mix fast 1.41x (1.76x per step),
because transformers is itself memory-bound here (1.09x the copy limit): a float32 decoder reads
the same 763 MB per step, and wint8mix reads 511 MB (1.49x fewer bytes; the float32 tied head is
424 MB of them, its MatMul 19.5 ms of the fast step's 24). 2.5x would need the head quantized too
(int8: about 190 MB a step), which no preset does. On a loaded machine (load average ~3 from other
sessions, an earlier run) transformers' step took 250-440 ms against ONNX float32's 80-90 ms
(xtr 3.8, wint8mix fast 5.3): torch degrades far more under CPU contention. (3) met: ONNX float32
0.87x and wint8mix fast 0.91x the copy limit (two threads reading beat one thread copying).
Prefill: a 1024-token prompt takes 2.46 s in ONNX float32 against transformers' 2.49 s.

Prefill (issue 41; 2026-12-06, 2 cores under load average 8-10 from other sessions; flags
--no-paddle --no-interpreter --no-profile --no-paddleformers --rounds 1 --reps 2 --new-tokens 16
--prefill-reps 5; copy bandwidth 8.4 GB/s; ms):

    generator                   pre@32 pre@1024  step@32 step@1024  ratio  tok/s   xtr  xtrst  xtrpre
    onnx float32                   934    13145    126.4     110.4   0.88   4.28  3.08   2.57    1.22
    onnx wint8mix fast             698     9872     91.1      92.6   1.04   3.83  2.76   3.56    1.62
    onnx wint8mix weight-only     1211    14668    114.3     129.2   1.12   3.12  2.25   2.79    1.12
    transformers                  2744    15713    320.0     389.6   1.25   1.39  1.00   1.00    1.00

Goal (4) met in this run: ONNX float32 and the default weight-only decoder took 0.82x and 0.89x
transformers' prefill time (xtrpre 1.22, 1.12; per rep 1.12-1.42 and 1.06-1.25). Caveat: under
contention torch slows more than onnxruntime (above), so a loaded run flatters ours; on a quiet
machine before these changes the issue measured float32 1.27x and weight-only 2.4x slower than
transformers. What changed, each measured against the form before it in one process, the two
forms taking turns (load ~10): (a) an int8 linear at accuracy_level 1 is an `If` on its rows,
from 384 rows one 8-bit MatMulNBits instead of two 4-bit planes (emit_onnx, `PREFILL_ROWS`): the
weight-only prefill took 0.81x the planes' time (4 rounds, 0.71-0.82), its decode step unchanged
(0.83x, within noise); (b) attention hides keys with an additive [B, 1, S, T] bias instead of a
`Where` over the [B, H, S, T] scores: Where + Add went from 8.0% to 2.1% of the float32 prefill's
onnxruntime kernel time, logits bit for bit the same. (MB/st of weight-only printed 602 in this
run: the 8-bit prefill copies were counted; a decode step does not read them, 514 now.)

Rerun with the same flags but --prefill-reps 3 on a quiet machine (2026-12-06, nothing else
running; copy bandwidth 26 GB/s): pre@1024 ONNX float32 3118 ms, wint8mix fast 2145, wint8mix
weight-only 3173, transformers 3718: xtrpre 1.12 (per rep 1.10-1.19), 1.51 and 1.14 (0.96-1.17):
goal (4) met on the medians (ours 0.89x and 0.88x transformers' time); one weight-only rep of
three was 1.04x transformers'.

    python benchmarks/generate.py [--layers 6] [--rounds 3] [--reps 10] [--block 3] [--warm 2]
        [--threads 2] [--prompt-tokens 32] [--new-tokens 64] [--long-context 1024]
        [--copy-mib 1024] [--prefill-reps 3] [--profile-steps 6] [--no-references]
        [--no-paddleformers] [--no-interpreter] [--no-paddle] [--no-profile] [--quick] [--workdir DIR]

--quick: 2 layers, 1 round, 3 reps, 16 new tokens, context 256, 512 MiB copies by default (a
smoke run, not the goals).
--workdir keeps the checkpoint (reused when its layer count matches) and the artifacts.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REF_SCRIPT = HERE / "_generate_ref.py"
MARK = "@@REF@@ "
SEED = 20

WIDTHS = {"hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
          "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 103424}
OURS = ("interpreter", "onnx float32", "onnx wint8mix fast", "onnx wint8mix weight-only",
        "paddle float32")
REFS = {"transformers": ("hf", "hf"), "paddleformers": ("pf", "pf")}
GOAL_FLAT, GOAL_F32, GOAL_FAST, GOAL_LIMIT, GOAL_PREFILL = 1.3, 1.5, 2.5, 2.0, 1.0

Run = dict[str, Any]
"""One generation: tokens, total_ms (the whole call), prefill_ms, decode_ms (each later step)."""


# -- the checkpoint ------------------------------------------------------------------------------
def config_for(layers: int) -> dict[str, Any]:
    return {"architectures": ["Ernie4_5_ForCausalLM"], "model_type": "ernie4_5", **WIDTHS,
            "num_hidden_layers": layers, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "tie_word_embeddings": True, "max_position_embeddings": 131072, "hidden_act": "silu",
            "use_bias": False, "use_cache": True, "torch_dtype": "float32", "dtype": "float32",
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def write_checkpoint(folder: Path, layers: int, seed: int = SEED) -> dict[str, Any]:
    """A transformers-layout ERNIE 4.5 dense float32 checkpoint with seeded weights: every matrix
    N(0, 1/fan_in) ([out, in], fan_in = in; the embedding table [V, H] too), norms 1 + 0.1 N(0,1)."""
    from ernie_ir.ir.weights import write_safetensors

    cfg = config_for(layers)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    rng = np.random.default_rng(seed)
    tensors: list[tuple[str, np.ndarray]] = []

    def mat(name: str, rows: int, cols: int) -> None:
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        w *= np.float32(cols ** -0.5)
        tensors.append((name, w))

    def norm(name: str) -> None:
        tensors.append((name, (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)))

    mat("model.embed_tokens.weight", v, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight")
        norm(p + "post_attention_layernorm.weight")
        mat(p + "self_attn.q_proj.weight", q, h)
        mat(p + "self_attn.k_proj.weight", kv, h)
        mat(p + "self_attn.v_proj.weight", kv, h)
        mat(p + "self_attn.o_proj.weight", h, q)
        mat(p + "mlp.gate_proj.weight", inter, h)
        mat(p + "mlp.up_proj.weight", inter, h)
        mat(p + "mlp.down_proj.weight", h, inter)
    norm("model.norm.weight")
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    params = sum(int(t.size) for _, t in tensors)
    return {"params": params, "bytes": 4 * params}


def links_folder(src: Path, dst: Path) -> Path:
    """A fresh folder of links to `src`'s files (paddleformers writes a metadata file into the
    folder it loads; a stale one from another checkpoint would mislead it)."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, dst / f.name)
        else:
            (dst / f.name).symlink_to(f.resolve())
    return dst


# -- bytes and bandwidth -------------------------------------------------------------------------
def weight_bytes_per_step(onnx_path: Path) -> int:
    """Bytes of the initializers a one-token step reads: all of them, once each, except a table
    that only Gather nodes read (one row of it) and the int8 linears' 8-bit prefill copies (read
    only by the `rows_many` branch of their If, which a one-token step does not take). The tied
    table is gathered from and transposed into the head, so it counts in full, once."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(onnx_path), load_external_data=False)
    consumers: dict[str, set[str]] = defaultdict(set)
    prefill_only: set[str] = set()  # read by the rows_many branch of an int8 linear's If only
    for node in model.graph.node:
        for name in node.input:
            consumers[name].add(node.op_type)
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                for sub in a.g.node:
                    for name in sub.input:
                        if a.g.name.startswith("rows_many"):
                            prefill_only.add(name)
                        else:
                            consumers[name].add(sub.op_type)
    total = 0
    for init in model.graph.initializer:
        if init.name in prefill_only and init.name not in consumers:
            continue
        size = int(np.prod(init.dims)) if init.dims else 1
        item = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        nbytes = size * item
        if uses_external_data(init):
            info = {e.key: e.value for e in init.external_data}
            nbytes = int(info.get("length", nbytes))
        if consumers.get(init.name) == {"Gather"} and init.dims:
            nbytes //= int(init.dims[0])
        total += nbytes
    return total


class Copier:
    """np.copyto between two `mib` MiB float32 buffers; bytes/s counted read + write (STREAM)."""

    def __init__(self, mib: int) -> None:
        self.src = np.full(mib * (1 << 20) // 4, 1.0, np.float32)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # touch every page first

    def bandwidth(self, repeat: int = 1) -> list[float]:
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            np.copyto(self.dst, self.src)
            out.append(2 * self.src.nbytes / (time.perf_counter() - t0))
        return out


# -- the generators ------------------------------------------------------------------------------
def refenvs_root() -> Path:
    """As tests/frontends/_fe_testkit.refenvs_root: $ERNIE_IR_REFENVS, /work/refenvs, the cache."""
    if "ERNIE_IR_REFENVS" in os.environ:
        return Path(os.environ["ERNIE_IR_REFENVS"])
    local = Path("/work/refenvs")
    return local if local.is_dir() else Path.home() / ".cache" / "ernie-ir" / "refenvs"


class RefServer:
    """benchmarks/_generate_ref.py in a reference environment, loaded once, asked per generation."""

    def __init__(self, env: str, lib: str, folder: Path, threads: int, log: Path) -> None:
        py = refenvs_root() / env / "bin" / "python"
        if not py.is_file():
            raise FileNotFoundError(f"reference environment {env!r} not found at {py.parent.parent} "
                                    "(tests/reference/install_envs.sh)")
        child_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        child_env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                          "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        self.log = log.open("w")
        self.proc = subprocess.Popen([str(py), str(REF_SCRIPT), lib, str(folder), str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, cwd=HERE, env=child_env)
        self.logpath = log
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                msg = json.loads(line[len(MARK):])
                if "error" in msg:
                    raise RuntimeError(f"{msg['error']} (log: {self.logpath})")
                return msg
        raise RuntimeError(f"reference process ended (rc {self.proc.wait()}); log: {self.logpath}")

    def ask(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompt: list[int], new: int) -> Run:
        run = self.ask({"cmd": "generate", "prompt": prompt, "new": new})
        want = [len(prompt)] + [1] * (new - 1)
        if run["input_lengths"] != want or len(run["tokens"]) != new:
            raise RuntimeError(f"the reference did not decode incrementally: fed {run['input_lengths']}")
        return run

    def prefill(self, state: str, prompt: list[int]) -> float:
        got = self.ask({"cmd": "prefill", "state": state, "prompt": prompt})
        if got["cache_length"] != len(prompt):
            raise RuntimeError(f"the reference's cache holds {got['cache_length']} tokens after a prefill of "
                               f"{len(prompt)}")
        return float(got["prefill_ms"])

    def steps(self, state: str, n: int) -> list[float]:
        return list(self.ask({"cmd": "steps", "state": state, "n": n})["ms"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


class Ours:
    """One of our generators: `generate` through the loop, and single decode steps on a fixed past."""

    def __init__(self, gen: Any) -> None:
        self.gen = gen
        self.states: dict[str, dict[str, np.ndarray]] = {}

    def generate(self, prompt: list[int], new: int) -> Run:
        from ernie_ir.generation import DecodeOptions

        t0 = time.perf_counter()
        r = self.gen.generate([prompt], DecodeOptions(max_new_tokens=new), ignore_eos=True)
        total = (time.perf_counter() - t0) * 1e3
        return {"tokens": r.new_tokens[0], "total_ms": total, "prefill_ms": r.prefill_ms,
                "decode_ms": list(r.decode_ms)}

    def prefill(self, state: str, prompt: list[int]) -> float:
        """The feeds of the step after `prompt` (its greedy token, its cache), kept as `state`."""
        from ernie_ir.runtime.decoding import PAST, PRESENT, empty_cache, left_pad

        d = self.gen.decoder
        ids, mask, pos = left_pad([prompt], 0)
        t0 = time.perf_counter()
        out = d.step({"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                      **empty_cache(d.cache_layers, 1)})
        ms = (time.perf_counter() - t0) * 1e3
        n = len(prompt)
        feeds = {"input_ids": np.asarray([[int(np.argmax(np.asarray(out["logits"])[0, -1]))]], np.int64),
                 "attention_mask": np.ones((1, n + 1), np.int64),
                 "position_ids": np.asarray([[n]], np.int64)}
        for i in range(len(d.cache_layers)):
            for kind in ("key", "value"):
                past = np.asarray(out[PRESENT.format(i=i, kind=kind)])
                assert past.shape[2] == n, past.shape
                feeds[PAST.format(i=i, kind=kind)] = past
        self.states[state] = feeds
        return ms

    def steps(self, state: str, n: int) -> list[float]:
        """`n` decode steps, each on the same past (the prompt's): wall ms of the step and the
        argmax of its logits, as the loop does."""
        feeds, step = self.states[state], self.gen.decoder.step
        ms = []
        for _ in range(n):
            t0 = time.perf_counter()
            out = step(feeds)
            int(np.argmax(np.asarray(out["logits"])[0, -1]))
            ms.append((time.perf_counter() - t0) * 1e3)
        return ms


# -- where the time goes -------------------------------------------------------------------------
def profile_onnx(path: Path, prompts: dict[str, list[int]], steps: int, warm: int,
                 prefix: Path) -> dict[str, Any]:
    """onnxruntime's profile of decode steps after each prompt: the prefill and the first `warm`
    steps left out, the next `steps` counted: ms per step by operator type and the largest nodes."""
    import onnxruntime as ort

    from ernie_ir.runtime.decoding import DecodeOptions, decode

    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = str(prefix)
    sess = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in sess.get_inputs()}
    names = [o.name for o in sess.get_outputs()]
    layers = []
    while f"past_key_values.{len(layers)}.key" in inputs:
        _, kv, _, d = inputs[f"past_key_values.{len(layers)}.key"].shape
        layers.append((int(kv), int(d)))

    def step(feeds: Any) -> dict[str, np.ndarray]:
        return dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in inputs}), strict=True))

    order = []
    for label, prompt in prompts.items():
        decode(step, layers, [prompt], DecodeOptions(max_new_tokens=1 + warm + steps))
        order += [(label, False)] * (1 + warm) + [(label, True)] * steps
    events = json.loads(Path(sess.end_profiling()).read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    out: dict[str, Any] = {}
    for label in prompts:
        spans = [(r["ts"], r["ts"] + r["dur"]) for r, (lab, counted) in zip(runs, order, strict=True)
                 if lab == label and counted]
        by_op: dict[str, float] = defaultdict(float)
        by_node: dict[str, float] = defaultdict(float)
        for e in nodes:
            if any(a <= e["ts"] <= b for a, b in spans):
                op = e.get("args", {}).get("op_name", "?")
                by_op[op] += e["dur"] / 1e3 / len(spans)
                by_node[f"{op} {e['name'][:-len('_kernel_time')]}"] += e["dur"] / 1e3 / len(spans)
        out[label] = {"step_ms": median([(b - a) / 1e3 for a, b in spans]), "kernels_ms": sum(by_op.values()),
                      "by_op_ms": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
                      "top_nodes_ms": dict(sorted(by_node.items(), key=lambda kv: -kv[1])[:5])}
    return out


# -- the run -------------------------------------------------------------------------------------
def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def spread(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": median(xs), "max": max(xs)} if xs else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="generate() calls per generator")
    ap.add_argument("--reps", type=int, default=10, help="rounds of interleaved single decode steps")
    ap.add_argument("--block", type=int, default=3, help="decode steps per generator, context and rep")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--long-context", type=int, default=1024)
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--warm", type=int, default=2,
                    help="untimed decode steps each time a generator takes its turn")
    ap.add_argument("--prefill-reps", type=int, default=3,
                    help="interleaved prefills of the --long-context prompt per generator")
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--no-references", action="store_true")
    ap.add_argument("--no-paddleformers", action="store_true", help="transformers as the only reference")
    ap.add_argument("--no-interpreter", action="store_true")
    ap.add_argument("--no-paddle", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a smoke run (2 layers, short, few repeats)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the checkpoint and artifacts here")
    args = ap.parse_args()
    if args.quick:  # other defaults; flags given still win
        ap.set_defaults(layers=2, rounds=1, reps=3, new_tokens=16, long_context=256, copy_mib=512)
        args = ap.parse_args()
    t_start = time.perf_counter()
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="ernie-ir-generate-")
        work = Path(tmp.name)
    else:
        work = args.workdir
        work.mkdir(parents=True, exist_ok=True)
    refs: dict[str, RefServer] = {}
    try:
        report = run(args, work, refs)
    finally:
        for r in refs.values():
            r.close()
        if tmp is not None:
            tmp.cleanup()
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(report))


def run(args: argparse.Namespace, work: Path, refs: dict[str, RefServer]) -> dict[str, Any]:
    from ernie_ir.generation import Generator
    from ernie_ir.targets.compile import CompileOptions, compile_model

    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    copier = Copier(args.copy_mib)
    bw_start = copier.bandwidth(5)
    log(f"copy bandwidth {median(bw_start) / 1e9:.2f} GB/s (read + write, {args.copy_mib} MiB buffers)")

    ckpt = work / "ckpt"
    t0 = time.perf_counter()
    if not (ckpt / "model.safetensors").is_file() or \
            json.loads((ckpt / "config.json").read_text())["num_hidden_layers"] != args.layers:
        shutil.rmtree(ckpt, ignore_errors=True)
        write_checkpoint(ckpt, args.layers)
    log(f"checkpoint {ckpt} ({args.layers} layers) in {time.perf_counter() - t0:.1f} s")

    builds = {"float32": {"emit": "onnx,paddle"},
              "wint8mix-fast": {"emit": "onnx", "quant": "wint8mix", "onnx_numerics": "fast"},
              "wint8mix-weight-only": {"emit": "onnx", "quant": "wint8mix", "onnx_numerics": "weight-only"}}
    arts: dict[str, Path] = {}
    compile_s: dict[str, float] = {}
    for name, kw in builds.items():
        t0 = time.perf_counter()
        options = CompileOptions(out=work / name, force=True, **kw)
        arts[name] = Path(compile_model(str(ckpt), "cuda", options).out)
        compile_s[name] = round(time.perf_counter() - t0, 1)
        gc.collect()
        log(f"compiled {name} in {compile_s[name]} s")
    onnx_file = {name: arts[name] / "inference" / "onnx" / "model.onnx" for name in arts}
    wbytes = {name: weight_bytes_per_step(p) for name, p in onnx_file.items()}

    if not args.no_paddle:
        import paddle

        paddle.base.core.set_num_threads(args.threads)  # as the paddleformers reference is given
    gens: dict[str, Ours | RefServer] = {}
    step_bytes: dict[str, int] = {}
    plan = [("interpreter", "float32", "interpreter"), ("onnx float32", "float32", "onnxruntime"),
            ("onnx wint8mix fast", "wint8mix-fast", "onnxruntime"),
            ("onnx wint8mix weight-only", "wint8mix-weight-only", "onnxruntime"),
            ("paddle float32", "float32", "paddle")]
    for label, art, backend in plan:
        if (label == "interpreter" and args.no_interpreter) or (backend == "paddle" and args.no_paddle):
            continue
        gens[label] = Ours(Generator(arts[art], backend=backend))
        step_bytes[label] = wbytes[art]
    versions: dict[str, Any] = {}
    if not args.no_references:
        for label, (env, lib) in REFS.items():
            if label == "paddleformers" and args.no_paddleformers:
                continue
            folder = ckpt if lib == "hf" else links_folder(ckpt, work / "ckpt-pf")
            t0 = time.perf_counter()
            refs[label] = RefServer(env, lib, folder, args.threads, work / f"{lib}.log")
            versions[label] = refs[label].hello["versions"]
            log(f"{label} loaded in {time.perf_counter() - t0:.1f} s")
            gens[label] = refs[label]
            step_bytes[label] = wbytes["float32"]
    labels = list(gens)

    rng = np.random.default_rng(SEED + 1)
    vocab = WIDTHS["vocab_size"]
    short = rng.integers(3, vocab, args.prompt_tokens).tolist()
    long = rng.integers(3, vocab, args.long_context).tolist()
    for g in gens.values():  # warm-up (first-call allocations, lazy inits)
        g.generate(short[:8], 3)
    log("warmed up")

    # -- A: generate(), whole calls, the generators taking turns ---------------------------------
    gen_runs: dict[str, list[Run]] = {label: [] for label in labels}
    for r in range(args.rounds):
        for label in labels[r % len(labels):] + labels[: r % len(labels)]:
            run_ = gens[label].generate(short, args.new_tokens)
            gen_runs[label].append(run_)
            log(f"generate round {r + 1} {label}: {run_['total_ms'] / 1e3:.2f} s, "
                f"step {median(run_['decode_ms']):.1f} ms")

    # -- B: single decode steps at both contexts, interleaved ------------------------------------
    prefill_ms: dict[str, dict[str, float]] = {}
    for label, g in gens.items():
        prefill_ms[label] = {"short": g.prefill("short", short), "long": g.prefill("long", long)}
        g.steps("short", 1)
        g.steps("long", 1)
        log(f"prefilled {label}: {prefill_ms[label]['long'] / 1e3:.2f} s for {len(long)} tokens")
    reps: list[dict[str, Any]] = []
    for r in range(args.reps):
        bw = copier.bandwidth(1)
        rep: dict[str, Any] = {}
        for label in labels[r % len(labels):] + labels[: r % len(labels)]:
            g = gens[label]
            first, second = ("short", "long") if r % 2 == 0 else ("long", "short")
            g.steps(first, args.warm)  # the first steps after another generator ran are slow
            got = {first: g.steps(first, args.block)}
            got[second] = g.steps(second, args.block)
            rep[label] = {k: median(v) for k, v in got.items()}
        bw += copier.bandwidth(1)
        rep["bandwidth"] = median(bw)
        reps.append(rep)
        log(f"steps rep {r + 1} (ms at {len(short)}/{len(long)}): "
            + ", ".join(f"{label} {rep[label]['short']:.0f}/{rep[label]['long']:.0f}" for label in labels)
            + f"; copy {rep['bandwidth'] / 1e9:.1f} GB/s")
    # -- C: prefill of the long prompt, whole calls, the generators taking turns -----------------
    pre_reps: list[dict[str, float]] = []
    for r in range(args.prefill_reps):
        pre_reps.append({label: gens[label].prefill("prefill", long)
                         for label in labels[r % len(labels):] + labels[: r % len(labels)]})
        log(f"prefill rep {r + 1} (ms at {len(long)}): "
            + ", ".join(f"{label} {pre_reps[-1][label]:.0f}" for label in labels))
    bandwidth = median(bw_start + copier.bandwidth(5) + [rep["bandwidth"] for rep in reps])
    del copier
    gc.collect()

    rows: dict[str, dict[str, Any]] = {}
    for label in labels:
        runs = gen_runs[label]
        limit_ms = [step_bytes[label] / rep["bandwidth"] * 1e3 for rep in reps]
        rows[label] = {
            "prefill_ms": median([x["prefill_ms"] for x in runs]),
            "prefill_long_ms": (median([p[label] for p in pre_reps]) if pre_reps
                                else prefill_ms[label]["long"]),
            "step_ms_short": median([rep[label]["short"] for rep in reps]),
            "step_ms_long": median([rep[label]["long"] for rep in reps]),
            "context_ratio": spread([rep[label]["long"] / rep[label]["short"] for rep in reps]),
            "tokens_per_s": median([args.new_tokens / (x["total_ms"] / 1e3) for x in runs]),
            "generate_step_ms": median([t for x in runs for t in x["decode_ms"]]),
            "weight_mb_per_step": step_bytes[label] / 1e6,
            "limit_ms": median(limit_ms),
            "x_limit": spread([rep[label]["short"] / lim for rep, lim in zip(reps, limit_ms, strict=True)]),
            "tokens": runs[-1]["tokens"],
        }
    for ref in refs:
        for label in labels:
            pairs = zip(gen_runs[ref], gen_runs[label], strict=True)
            rows[label][f"x_{ref}"] = spread([a["total_ms"] / b["total_ms"] for a, b in pairs])
            rows[label][f"x_{ref}_step"] = spread([rep[ref]["short"] / rep[label]["short"] for rep in reps])
            rows[label][f"agree_{ref}"] = leading_agreement(rows[label]["tokens"], rows[ref]["tokens"])
            rows[label][f"x_{ref}_prefill"] = spread([p[ref] / p[label] for p in pre_reps])

    profile: dict[str, Any] = {}
    if not args.no_profile:
        gens.clear()
        gc.collect()
        prompts = {f"ctx{len(short)}": short, f"ctx{len(long)}": long}
        for name in ("float32", "wint8mix-fast"):
            profile[name] = profile_onnx(onnx_file[name], prompts, args.profile_steps, args.warm,
                                         work / "profile" / name)
            gc.collect()

    goals = {}
    for label in OURS:
        if label in rows:
            goals[f"flat {label}: step at {args.long_context} / at {args.prompt_tokens} <= {GOAL_FLAT}"] = \
                rows[label]["context_ratio"]["median"] <= GOAL_FLAT
    if "transformers" in refs:
        for label, goal in (("onnx float32", GOAL_F32), ("onnx wint8mix fast", GOAL_FAST)):
            goals[f"{label} >= {goal}x transformers tokens/s (generate)"] = \
                rows[label]["x_transformers"]["median"] >= goal
    for label in ("onnx float32", "onnx wint8mix fast"):
        goals[f"{label} <= {GOAL_LIMIT}x the bandwidth limit"] = \
            rows[label]["x_limit"]["median"] <= GOAL_LIMIT
    if "transformers" in refs and pre_reps:
        for label in ("onnx float32", "onnx wint8mix weight-only"):
            goals[f"{label} prefill of {args.long_context} tokens <= {GOAL_PREFILL}x transformers' time"] = \
                rows[label]["x_transformers_prefill"]["median"] >= 1 / GOAL_PREFILL

    print_table(rows, args, bandwidth, list(refs))
    for name, prof in profile.items():
        for ctx, p in prof.items():
            ops = ", ".join(f"{op} {ms:.1f}" for op, ms in list(p["by_op_ms"].items())[:8])
            top = ", ".join(f"{n} {ms:.1f}" for n, ms in list(p["top_nodes_ms"].items())[:3])
            print(f"profile onnx {name} {ctx}: step {p['step_ms']:.1f} ms (kernels {p['kernels_ms']:.1f}): "
                  f"{ops}; largest: {top}")
        (c1, a), (c2, b) = list(prof.items())[:2]
        grew = {op: b["by_op_ms"].get(op, 0.0) - a["by_op_ms"].get(op, 0.0)
                for op in set(a["by_op_ms"]) | set(b["by_op_ms"])}
        grew = dict(sorted(grew.items(), key=lambda kv: -kv[1])[:6])
        prof["growth_ms"] = grew
        print(f"profile onnx {name} {c2} - {c1}: kernels {b['kernels_ms'] - a['kernels_ms']:+.1f} ms: "
              + ", ".join(f"{op} {ms:+.1f}" for op, ms in grew.items()))
    for goal, ok in goals.items():
        print(f"goal {'MET ' if ok else 'MISS'} {goal}")
    for row in rows.values():
        row.pop("tokens")
    return {"benchmark": "generate", "layers": args.layers, "threads": args.threads,
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "long_context": args.long_context, "rounds": args.rounds, "reps": args.reps, "block": args.block,
            "copy_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes_per_step": wbytes,
            "compile_s": compile_s, "reference_versions": versions, "rows": rows, "profile": profile,
            "goals": goals}


def print_table(rows: dict[str, dict[str, Any]], args: argparse.Namespace, bandwidth: float,
                refs: list[str]) -> None:
    c1, c2 = args.prompt_tokens, args.long_context
    short_names = {r: r[:2] for r in refs}
    head = (f"{'generator':<26}{'pre@' + str(c1):>8}{'pre@' + str(c2):>9}{'step@' + str(c1):>9}"
            f"{'step@' + str(c2):>10}{'ratio':>7}{'tok/s':>7}"
            + "".join(f"{'x' + short_names[r]:>6}{'x' + short_names[r] + 'st':>7}"
                      f"{'x' + short_names[r] + 'pre':>8}" for r in refs)
            + f"{'MB/st':>7}{'limit':>7}{'xlim':>6}")
    print(f"\nERNIE-4.5-0.3B widths, {args.layers} layers, batch 1, greedy, {args.threads} threads; ms. "
          f"pre@N: prefill of N tokens (pre@{c2}: median of {args.prefill_reps} interleaved reps); "
          f"step@N: one decode step on a past of N (median of {args.reps} "
          f"interleaved reps x {args.block}); ratio: step@{c2} / step@{c1}; tok/s: {args.new_tokens} new "
          f"tokens after {c1} / wall of generate() (median of {args.rounds}); xtr, xpa: that over "
          f"transformers' / paddleformers'; xtrst, xpast: the same for step@{c1}; "
          f"xtrpre, xpapre: their pre@{c2} over this one's, per rep (>= 1: as fast or faster); "
          f"MB/st: weight MB read per step; limit: MB/st over the copy bandwidth "
          f"({bandwidth / 1e9:.2f} GB/s read+write); "
          f"xlim: step@{c1} / limit")
    print(head)
    for label, r in rows.items():
        line = (f"{label:<26}{r['prefill_ms']:>8.0f}{r['prefill_long_ms']:>9.0f}{r['step_ms_short']:>9.1f}"
                f"{r['step_ms_long']:>10.1f}{r['context_ratio']['median']:>7.2f}{r['tokens_per_s']:>7.2f}")
        for ref in refs:
            line += (f"{r[f'x_{ref}']['median']:>6.2f}{r[f'x_{ref}_step']['median']:>7.2f}"
                     f"{r[f'x_{ref}_prefill'].get('median', float('nan')):>8.2f}")
        line += f"{r['weight_mb_per_step']:>7.0f}{r['limit_ms']:>7.1f}{r['x_limit']['median']:>6.2f}"
        print(line)
    if refs:
        agree = "; ".join(f"{label} " + "/".join(str(r[f"agree_{ref}"]) for ref in refs)
                          for label, r in rows.items())
        print(f"leading generated tokens (of {args.new_tokens}) equal to {' / '.join(refs)}: {agree}")
    print()


if __name__ == "__main__":
    sys.exit(main())
