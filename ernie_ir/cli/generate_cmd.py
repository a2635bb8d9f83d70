"""`ernie-ir generate`: text (or token ids) from a model or an artifact, decoded with a KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .common import BackendOpt, ModelArg, TrustOpt, chosen_backend, err, out, say_backend

if TYPE_CHECKING:
    from ernie_ir.generation import Generator


def _parse_ids(text: str, flag: str) -> list[list[int]]:
    """`1,2,3` (one prompt) or a .npy file of token ids [batch, seq] (one prompt per row)."""
    from ernie_ir.ir import ErnieIRError

    if text.endswith(".npy"):
        from ernie_ir.ir.inputs import read_token_ids

        if not Path(text).exists():
            raise ErnieIRError(f"{flag} {text}: no such file")
        return read_token_ids(text, f"{flag} file").tolist()
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ErnieIRError(f"{flag} {text!r}: expected comma-separated integers such as 1,2,3 or a "
                           ".npy file") from None
    if not values:
        raise ErnieIRError(f"{flag}: the prompt is empty: give at least one token id")
    return [values]


def _read_prompts(path: Path, gen: Generator, chat: bool) -> list[list[int]]:
    """A JSON Lines file: per line a string (text), a list of ints (ids), or an object with
    "prompt" (text) or "ids" (token ids). Blank lines are skipped."""
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.ir.inputs import read_text_or_ids_lines

    rows = [gen.encode(item, chat=chat) if isinstance(item, str) else item
            for _, item in read_text_or_ids_lines(path, "prompts file", "prompt", "ids", ErnieIRError)]
    if not rows:
        raise ErnieIRError(f"--prompts {path}: the file holds no prompt")
    return rows


GreedyOpt = Annotated[bool | None, typer.Option(
    "--greedy/--do-sample", help="--greedy: take the most likely token (the default unless a sampling option "
    "is given); --do-sample (transformers' name): sample, at temperature 1 over every token unless "
    "--temperature/--top-p/--top-k say otherwise.")]


def generate(
    model: ModelArg,
    prompt: Annotated[str | None, typer.Option("--prompt", help="Prompt text (needs the model's "
                                               "tokenizer).")] = None,
    prompt_ids: Annotated[str | None, typer.Option("--prompt-ids", help="Prompt token ids: 1,2,3 or a "
                                                   ".npy [batch, seq].")] = None,
    prompts: Annotated[Path | None, typer.Option(
        "--prompts", help="A JSON Lines file, one prompt per line: text, [ids], {\"prompt\": ...} or "
        "{\"ids\": ...}.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Tokens to generate per "
                                                "prompt (at most).")] = 32,
    greedy: GreedyOpt = None,
    temperature: Annotated[float | None, typer.Option("--temperature", help="Sample: divide the logits "
                                                      "by T > 0.")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="Sample from the smallest set of tokens "
                                                "whose probability reaches P, in (0, 1].")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Sample from the K most likely "
                                              "tokens.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of the sampler.")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="End a row when its text contains "
                                                   "this (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Generate exactly --max-new-tokens "
                                             "(EOS does not end a row).")] = False,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each text prompt in the tokenizer's chat "
                                       "template.")] = False,
    backend: BackendOpt = "auto",
    kv_cache_dtype: Annotated[str | None, typer.Option(
        "--kv-cache-dtype", help="The cache's dtype (default: the artifact's, else the "
        "attention's).")] = None,
    compare_to: Annotated[str | None, typer.Option("--compare-to", help="A reference MODEL, run "
                                                   "teacher-forced on the generated tokens.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Seconds a multi-rank paddle run may "
                                                  "take (default 600).")] = None,
    trust_pickle: TrustOpt = False,
) -> None:
    """Generate tokens after prompts, decoding with a KV cache; text streams as it is produced."""
    import json

    from ernie_ir.generation import DecodeOptions
    from ernie_ir.generation import compare_to as compare
    from ernie_ir.ir import ErnieIRError

    _check_prompt_flags(prompt, prompt_ids, prompts, max_new_tokens, timeout)
    sampling = _sampling(greedy, temperature, top_p, top_k, seed)
    gen, note = _open(model, backend, kv_cache_dtype, trust_pickle, timeout)
    backend = gen.decoder.backend
    if prompt is not None:
        rows = [gen.encode(prompt, chat=chat)]
    elif prompt_ids is not None:
        if chat:
            raise ErnieIRError("--chat wraps text prompts: give --prompt (or drop --chat)")
        rows = _parse_ids(prompt_ids, "--prompt-ids")
    else:
        assert prompts is not None
        rows = _read_prompts(prompts, gen, chat)
    if stop:
        gen.require_tokenizer("--stop")
    rows = gen.check(rows, max_new_tokens)
    say_backend(note)

    tok = gen.tokenizer
    streaming = not json_out and len(rows) == 1
    stream = tok.stream(rows[0]) if streaming and tok is not None else None

    shown: list[str] = []  # what streamed: no empty line where no id had text

    def on_token(_row: int, token: int) -> None:
        if not streaming:
            return
        text = stream.push(gen.known([token])) if stream is not None else f"{token} "
        if text:
            out.print(text, end="", markup=False, highlight=False)
            out.file.flush()
            shown.append(text)

    result = gen.generate(rows, DecodeOptions(max_new_tokens=max_new_tokens, sampling=sampling),
                          stop_texts=stop or (), ignore_eos=ignore_eos, on_token=on_token)
    texts = [gen.text(n) for n in result.new_tokens] if tok is not None else None
    if streaming:
        if stream is not None:
            shown.append(stream.flush())
            out.print(shown[-1], end="", markup=False, highlight=False)
        if "".join(shown):
            out.print("")
    comparison = compare(compare_to, result, trust_pickle=trust_pickle) if compare_to is not None else None
    if json_out:
        print(json.dumps(_json_report(model, backend, result, texts, comparison)))
        return
    if not streaming:
        for r, new in enumerate(result.new_tokens):
            row_text = texts[r] if texts is not None else " ".join(map(str, new))
            out.print(f"[{r}] {row_text}", markup=False, highlight=False)
    if tok is not None:
        for line in untokenized_notes(result.new_tokens, tok.vocab_size, rows=not streaming):
            err.print(line, markup=False, highlight=False)
    _print_summary(result, len(rows), backend, comparison, compare_to)


UNTOKENIZED_SHOWN = 8
"""Ids outside the tokenizer named per row in the note; --json lists every id."""


def untokenized_notes(new_tokens: list[list[int]], vocab_size: int, *, rows: bool) -> list[str]:
    """One stderr line per row whose generated ids include some the tokenizer does not have (a
    model's vocabulary is often padded past its tokenizer's): those have no text, and a row of
    only such ids would otherwise print nothing. `rows`: prefix each line with its row, [r]."""
    lines = []
    for r, new in enumerate(new_tokens):
        outside = [t for t in new if not 0 <= t < vocab_size]
        if not outside:
            continue
        named = ", ".join(map(str, outside[:UNTOKENIZED_SHOWN]))
        more = f" and {len(outside) - UNTOKENIZED_SHOWN} more" if len(outside) > UNTOKENIZED_SHOWN else ""
        lines.append(f"{f'[{r}] ' if rows else ''}note: {len(outside)} of the {len(new)} generated ids are "
                     f"outside the tokenizer's vocabulary of {vocab_size} and have no text: {named}{more} "
                     "(--json lists every id)")
    return lines


def _open(model: str, backend: str, kv_cache_dtype: str | None, trust_pickle: bool,
          timeout: float | None) -> tuple[Generator, str | None]:
    """The Generator on the backend asked for (`auto`: chosen), and the line that says which."""
    from ernie_ir.generation import Generator

    if kv_cache_dtype is not None:
        from ernie_ir.targets.options import check_kv_cache_dtype

        kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype, "inference")
    backend, note = chosen_backend(model, backend)
    return Generator(model, backend, kv_cache_dtype=kv_cache_dtype, trust_pickle=trust_pickle,
                     timeout_s=timeout), note


def _check_prompt_flags(prompt: str | None, prompt_ids: str | None, prompts: Path | None,
                        max_new_tokens: int, timeout: float | None) -> None:
    """One source of prompts, a positive token budget, a finite timeout, an existing file."""
    from ernie_ir.ir import ErnieIRError

    given = [f for f, v in (("--prompt", prompt), ("--prompt-ids", prompt_ids), ("--prompts", prompts))
             if v is not None]
    if len(given) != 1:
        raise ErnieIRError("give one of --prompt TEXT, --prompt-ids IDS or --prompts FILE.jsonl"
                           + (f" (got {' and '.join(given)})" if given else ""))
    if max_new_tokens < 1:
        raise ErnieIRError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if timeout is not None and not 0 < timeout < float("inf"):
        raise ErnieIRError(f"--timeout {timeout}: give a finite number of seconds above 0")
    if prompts is not None and not prompts.is_file():
        raise ErnieIRError(f"--prompts {prompts}: no such file")


def _sampling(greedy: bool | None, temperature: float | None, top_p: float | None, top_k: int | None,
              seed: int | None) -> Any:
    """The sampler the flags ask for: greedy unless --do-sample (`greedy` False) or a sampling
    option is given (not with --greedy)."""
    from ernie_ir.generation import SamplingOptions
    from ernie_ir.ir import ErnieIRError

    sampled = [f for f, v in (("--temperature", temperature), ("--top-p", top_p), ("--top-k", top_k))
               if v is not None]
    if greedy and sampled:
        raise ErnieIRError(f"--greedy and {sampled[0]} contradict: drop one (greedy takes the most likely "
                           "token)")
    sampling = SamplingOptions(greedy=not sampled and greedy is not False,
                               temperature=1.0 if temperature is None else temperature,
                               top_p=1.0 if top_p is None else top_p, top_k=top_k, seed=seed)
    sampling.check()
    return sampling


def _json_report(model: str, backend: str, result: Any, texts: list[str] | None,
                 comparison: Any) -> dict[str, Any]:
    """`generate --json`: the sequences, the new tokens (and texts), timings, the comparison."""
    data: dict[str, Any] = {
        "model": model, "backend": backend, "sequences": result.sequences,
        "new_tokens": result.new_tokens, "finish_reasons": result.finish_reasons,
        "prefill_ms": round(result.prefill_ms, 3),
        "decode_ms_per_token": round(result.decode_ms_per_token, 3),
    }
    if texts is not None:
        data["texts"] = texts
    if comparison is not None:
        data["compare"] = {"reference": comparison.reference,
                           "first_divergence": comparison.first_divergence,
                           "top1_agreement": comparison.agreement}
    return data


def _print_summary(result: Any, rows: int, backend: str, comparison: Any, compare_to: str | None) -> None:
    """The stderr lines after the text: tokens, finish reasons, timings, the comparison."""
    steps = sum(len(n) for n in result.new_tokens)
    err.print(f"{steps} tokens in {rows} row(s) ({', '.join(sorted(set(result.finish_reasons)))}); "
              f"prefill {result.prefill_ms:.1f} ms, decode {result.decode_ms_per_token:.2f} ms/token "
              f"({backend})", markup=False)
    if comparison is not None:
        pairs = zip(comparison.first_divergence, comparison.agreement, strict=True)
        for r, (first, agree) in enumerate(pairs):
            where = "never diverges" if first is None else f"first diverges at step {first}"
            err.print(f"[{r}] against {compare_to}: {where}; top-1 agreement {agree:.1%}", markup=False)
