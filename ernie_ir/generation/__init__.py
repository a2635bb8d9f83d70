"""Generating text: a model or artifact as a KV-cache decoder on any backend, its tokenizer, the loop.

    from ernie_ir.generation import Generator
    gen = Generator("artifacts/ernie-cuda-wint8mix", backend="onnxruntime")
    result = gen.generate([gen.encode("Hello")], DecodeOptions(max_new_tokens=16))
    print(gen.text(result.new_tokens[0]))

Layer (docs/architecture.md): above `targets` and `frontends` (it makes the decoder graph with
the `kv-cache` pass, runs it with `runtime`, reads text with the frontends' tokenizers); only
`cli` imports it.
"""

from __future__ import annotations

from ernie_ir.runtime.decoding import DecodeError, DecodeOptions, DecodeResult, SamplingOptions

from .compare import Comparison, compare_to
from .decoders import Decoder, open_decoder
from .generator import Generator, generate

__all__ = ["Comparison", "DecodeError", "DecodeOptions", "DecodeResult", "Decoder", "Generator",
           "SamplingOptions", "compare_to", "generate", "open_decoder"]
