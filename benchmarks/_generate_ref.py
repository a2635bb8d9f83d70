"""Reference side of benchmarks/generate.py: one library's greedy `generate`, served over stdin.

Runs inside a reference environment ($ERNIE_IR_REFENVS/<env>, tests/reference/README.md), as a
subprocess of benchmarks/generate.py, and never imports ernie_ir:

    <env>/bin/python benchmarks/_generate_ref.py hf|pf CHECKPOINT_FOLDER THREADS

- hf: transformers `Ernie4_5ForCausalLM.from_pretrained(folder, dtype=torch.float32)` (torch CPU,
  float32), `generate(do_sample=False, eos_token_id=None, use_cache=True, attention_mask=ones)`:
  its default DynamicCache, so it decodes incrementally (REFERENCE.md 9.4).
- pf: paddleformers `Ernie4_5ForCausalLM.from_pretrained(folder, config=cfg, dtype="float32")`
  of the same HF-layout folder (paddleformers 1.2 reads it; `cfg.fuse_rms_norm = False`, as its
  CPU needs), `generate(decode_strategy="greedy_search", past_key_values=DynamicCache(config=
  model.config), position_ids=arange, attention_mask=ones, use_cache=True, eos_token_id=-1)`:
  without the DynamicCache it recomputes the whole sequence every step; without explicit
  position ids a cached forward fails; eos -1 is an id that cannot occur (None would fall back to
  the config's). paddleformers writes `flex-ckpt.auto_generated.metadata` into the folder it
  loads, so benchmarks/generate.py hands it a folder of links to the checkpoint's files.

Protocol: one JSON object per stdin line; each answer is one stdout line `@@REF@@ {json}` (the
libraries' own prints are other lines, to be skipped). The first answer, unasked, is
`{"ready": true, "versions": ..., "load_s": ..., "threads": ...}` (or `{"error": ...}`).
Requests:
- `{"cmd": "generate", "prompt": [ids], "new": N}` -> `{"tokens": [N new ids], "total_ms": wall of
  the generate call, "prefill_ms": its first forward, "decode_ms": [each later forward],
  "input_lengths": [tokens fed per forward]}` (a forward pre/post hook on the model times each
  forward; `input_lengths` shows it decoded incrementally: the prompt, then 1, 1, ...);
- `{"cmd": "prefill", "state": NAME, "prompt": [ids]}` -> `{"prefill_ms", "cache_length"}`: one
  forward of the prompt into a fresh DynamicCache, kept as state NAME with its greedy next token;
- `{"cmd": "steps", "state": NAME, "n": N}` -> `{"ms": [N forward wall times]}`: N one-token
  forwards (the next token, position = the prompt's length, mask of ones) on that cache, each
  followed by `cache.crop(-1)` (untimed), so every step reads the same context length; the time
  covers the forward and the argmax of its last logits;
- `{"cmd": "quit"}`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MARK = "@@REF@@ "


def answer(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Clock:
    """Wall time of each forward (pre-hook to post-hook) and the tokens it was fed."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.ms: list[float] = []
        self.lengths: list[int] = []

    def start(self, n: int) -> None:
        self.lengths.append(int(n))
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        self.ms.append((time.perf_counter() - self.t0) * 1e3)


def load_hf(folder: Path, threads: int):
    import torch
    import transformers
    from transformers import DynamicCache, Ernie4_5ForCausalLM

    torch.set_num_threads(threads)
    model = Ernie4_5ForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    clock = Clock()

    def pre(_m: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        clock.start(ids.shape[1])

    def post(_m: Any, _a: tuple, _k: dict[str, Any], _out: Any) -> None:
        clock.stop()

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)

    def generate(prompt: list[int], new: int) -> list[int]:
        ids = torch.tensor([prompt], dtype=torch.int64)
        with torch.no_grad():
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new, eos_token_id=None, use_cache=True)
        return seq[0, len(prompt):].tolist()

    def forward(ids: list[list[int]], cache: Any, start: int) -> int:
        x = torch.tensor(ids, dtype=torch.int64)
        n = x.shape[1]
        with torch.no_grad():
            out = model(input_ids=x, attention_mask=torch.ones((1, start + n), dtype=torch.int64),
                        position_ids=torch.arange(start, start + n, dtype=torch.int64)[None],
                        cache=cache, use_cache=True)
            return int(out.logits[0, -1].argmax())

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "torch_threads": torch.get_num_threads()}
    return generate, forward, lambda: DynamicCache(config=model.config), clock, versions


def load_pf(folder: Path, threads: int):
    import paddle
    import paddleformers
    from paddleformers.transformers import Ernie4_5Config, Ernie4_5ForCausalLM
    from paddleformers.transformers.cache_utils import DynamicCache

    paddle.set_device("cpu")
    paddle.base.core.set_num_threads(threads)
    cfg = Ernie4_5Config.from_pretrained(str(folder))
    cfg.fuse_rms_norm = False  # the fused kernel is GPU-only; the HF-written config lacks the key
    model = Ernie4_5ForCausalLM.from_pretrained(str(folder), config=cfg, dtype="float32")
    model.eval()
    clock = Clock()

    def pre(_m: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        clock.start(ids.shape[1])

    def post(_m: Any, _a: tuple, _k: dict[str, Any], _out: Any) -> None:
        clock.stop()

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_post_hook(post, with_kwargs=True)

    def generate(prompt: list[int], new: int) -> list[int]:
        n = len(prompt)
        with paddle.no_grad():
            out, _ = model.generate(
                input_ids=paddle.to_tensor([prompt], dtype="int64"),
                attention_mask=paddle.ones([1, n], dtype="int64"),
                position_ids=paddle.arange(n, dtype="int64").unsqueeze(0),
                past_key_values=DynamicCache(config=model.config),
                use_cache=True, decode_strategy="greedy_search", max_new_tokens=new, eos_token_id=-1)
        return out.numpy()[0].tolist()

    def forward(ids: list[list[int]], cache: Any, start: int) -> int:
        n = len(ids[0])
        with paddle.no_grad():
            out = model(input_ids=paddle.to_tensor(ids, dtype="int64"),
                        attention_mask=paddle.ones([1, start + n], dtype="int64"),
                        position_ids=paddle.arange(start, start + n, dtype="int64").unsqueeze(0),
                        past_key_values=cache, use_cache=True)
            return int(out.logits[0, -1].argmax())

    versions = {"paddle": paddle.__version__, "paddleformers": paddleformers.__version__}
    return generate, forward, lambda: DynamicCache(config=model.config), clock, versions


def main() -> None:
    lib, folder, threads = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    try:
        generate, forward, new_cache, clock, versions = (load_hf if lib == "hf" else load_pf)(folder, threads)
    except Exception as e:
        answer({"error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from None
    answer({"ready": True, "lib": lib, "versions": versions, "load_s": time.perf_counter() - t0,
            "threads": threads})
    states: dict[str, tuple[Any, int, int]] = {}  # name -> (cache of `length` tokens, next token, length)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("cmd") == "quit":
            break
        try:
            if req["cmd"] == "prefill":
                cache = new_cache()
                t = time.perf_counter()
                token = forward([list(req["prompt"])], cache, 0)
                states[req["state"]] = (cache, token, len(req["prompt"]))
                answer({"prefill_ms": (time.perf_counter() - t) * 1e3,
                        "cache_length": cache.get_seq_length()})
                continue
            if req["cmd"] == "steps":
                cache, token, length = states[req["state"]]
                ms = []
                for _ in range(int(req["n"])):
                    t = time.perf_counter()
                    forward([[token]], cache, length)
                    ms.append((time.perf_counter() - t) * 1e3)
                    cache.crop(-1)  # back to `length` tokens: every step sees the same context
                if cache.get_seq_length() != length:
                    raise RuntimeError(f"cache holds {cache.get_seq_length()} tokens, not {length}")
                answer({"ms": ms})
                continue
            clock.ms.clear()
            clock.lengths.clear()
            t = time.perf_counter()
            tokens = generate(list(req["prompt"]), int(req["new"]))
            total = (time.perf_counter() - t) * 1e3
            answer({"tokens": tokens, "total_ms": total, "prefill_ms": clock.ms[0],
                    "decode_ms": clock.ms[1:], "input_lengths": list(clock.lengths)})
        except Exception as e:
            answer({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
