"""Fine-tuning data files (JSON Lines) as the (input_ids, labels) rows of runtime's training loop.

    from ernie_ir.finetune import read_sft_data
    rows = read_sft_data(Path("train.jsonl"), tokenizer, max_seq_len=4096)
    # [(input_ids, labels), ...]; labels == ignore_index (-100) where no loss is wanted

One example per line; the keys tell the format (lines of different formats may be mixed):

- **ERNIEKit SFT** (REFERENCE.md 11): `src` (user turns), `tgt` (assistant turns), a string
  meaning a list of one; optional `system` (a string), `label` (0/1 per turn, default all 1:
  which answers are learned) and `is_system: 1` (ERNIEKit's: the first turn is the system
  prompt). Turn contents are stripped, as ERNIEKit strips them; an empty turn is an error
  (ERNIEKit skips the example). **alpaca**: `instruction` + optional `input` (concatenated as
  they are, as ERNIEKit's alpaca reader does) is the one user turn, `output` its answer,
  optional `system`.
- **text** `{"text": "..."}`: pretraining-style, every token is a target. Encoded with the
  tokenizer's normal rule (`encode(text)`, so its BOS rule applies), then the EOS id is appended
  unless the ids already end with it (or the tokenizer names no EOS), so the model learns where a
  document ends.
- **token ids** `{"input_ids": [...], "labels": [...]}` (`labels` optional: every token a target):
  passed through as they are; the runtime checks them against the model's vocabulary. These
  lines need no tokenizer.

Chat turns are tokenized with the tokenizer's own chat template, the way paddleformers' and
ERNIEKit's `encode_chat_inputs` cut a conversation: the template is rendered on growing message
prefixes and the pieces are the string differences. The *header* is the render of the system
message alone (of no message without one); turn i's prompt is the render up to user turn i with
the generation prompt minus the render up to answer i-1; its answer is the render up to answer i
minus that. Every render must extend the previous one (otherwise the template rewrites earlier
turns and the data cannot be cut into turns: an error). Each piece is encoded on its own with
`encode(piece, add_special_tokens=False)` (the header and turn 1's prompt as one text, as
ERNIEKit's first turn): special-token text the template writes (ERNIE's `<|begin_of_sentence|>`,
`<|end_of_sentence|>`) becomes its id, nothing else is added, as in transformers'
`apply_chat_template(tokenize=True)`.

An answer ends with an end token: if its ids, trailing whitespace tokens aside, do not end with
the EOS id, `<|end_of_sentence|>` or another stop id of the tokenizer (`stop_token_ids`), the EOS
id is appended. As in ERNIEKit, a learned `<|end_of_sentence|>` is predicted as the EOS id: its
label is the EOS id while the input keeps `<|end_of_sentence|>`.

**Labels: ERNIEKit's loss mask in our convention.** The runtime scores logits[:, :-1] against
labels[:, 1:]: labels[j] is the token that position j - 1 must predict; labels[0] is never
scored. ERNIEKit writes its mask on its own shifted convention: over the concatenated tokens
`src_1 + tgt_1 + src_2 + ...`, mask[k] says whether position k's prediction of token k + 1
counts, per turn `[0] * (len(src) - 1) + [label] * (len(tgt) + 1)`: the last prompt token predicts
the first answer token and each answer token the next; then it deletes the row's last token and
its mask. Ours: labels[j] = ERNIEKit's target of position j - 1 where mask[j - 1] is 1, that is
the token at j (the EOS id for `<|end_of_sentence|>`) for every answer token j of a turn whose
label is 1, the first prompt token of a turn that follows a learned answer, and ignore_index
everywhere else (header, prompts, answers of label-0 turns).
Worked example: turn 1 `src [B u1 u2]` (B: the header) `tgt [a1 E]`, turn 2 `src [v1]`
`tgt [b1 E]`, both label 1 (E = `<|end_of_sentence|>`, X = ignore_index):

    position          0   1   2   3   4    5   6   7
    input_ids         B   u1  u2  a1  E    v1  b1  E
    ERNIEKit mask     0   0   1   1   1    1   1   (deleted)   targets: a1 E v1 b1 E
    our labels        X   X   X   a1  EOS  v1  b1  EOS

ERNIEKit's `+ 1` makes the end token of a learned answer that another turn follows predict that
turn's first prompt token (position 4 -> v1 above): kept, so every target is ERNIEKit's, bit for
bit. The row keeps its last token (ERNIEKit deletes it): the runtime needs it in the row to
score the last answer token, and never scores the logits at it.

**Truncation** (`max_seq_len`, ERNIEKit's rule): turns are kept from the newest backwards while
header + kept turns fit in `max_seq_len` tokens; the first turn that does not fit and every
older one are dropped; the header (the template's start and the system prompt) is always kept
(ERNIEKit keeps only its begin token). ERNIEKit's budget reserves 8 tokens per turn for its
packing; there is no packing here, so the fit is exact. If not even the newest turn fits, the
example is an error (ERNIEKit skips it): raise `--max-seq-len` or shorten the example. A text
line or a token-id line longer than `max_seq_len` is cut at the tail (a cut text loses its EOS).
An example that has nothing to learn (every kept answer has label 0, every label ignore_index)
is an error, as ERNIEKit skips it.

**No packing** (`PACKING_REFUSED`): one example per row, rows padded to the batch's longest.

Every problem is an `SftDataError` (an `ErnieIRError`) of one line: `path:line`, what is wrong,
how to fix it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ernie_ir.frontends.tokenizer import Tokenizer
from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.inputs import read_bytes

__all__ = ["END_OF_SENTENCE", "PACKING_REFUSED", "SftDataError", "read_sft_data"]

END_OF_SENTENCE = "<|end_of_sentence|>"
"""ERNIE's end-of-answer token; ERNIEKit trains the EOS id where it stands in an answer."""

PACKING_REFUSED = (
    "packing is not supported: the training graph's attention is causal over the whole row and "
    "has no per-example (block-diagonal) mask input, so packed examples would attend across their "
    "boundaries; each example is its own row, padded to the batch's longest row instead"
)

_ACCEPTED = ('{"src": ..., "tgt": ...} (ERNIEKit SFT), {"instruction": ..., "output": ...} (alpaca), '
             '{"text": ...} or {"input_ids": [...]}')
_FORMATS = (("ERNIEKit SFT", ("src", "tgt")), ("alpaca", ("instruction", "output")),
            ("text", ("text",)), ("input_ids", ("input_ids",)))


class SftDataError(ErnieIRError):
    """A fine-tuning data file that cannot be read: one line naming path:line, the problem, the fix."""


class _LineError(Exception):
    """A problem with one line; read_sft_data adds `path:line`."""


@dataclass
class _Chat:
    system: str | None
    turns: list[tuple[str, str]]  # (user, assistant), stripped
    labels: list[int]


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _short(value: Any) -> str:
    text = _one_line(repr(value))
    return text if len(text) <= 60 else text[:57] + "..."


# -- one line as an example ------------------------------------------------------------------------


def _format_of(row: Mapping[str, Any]) -> str:
    found = [name for name, keys in _FORMATS if any(k in row for k in keys)]
    if not found:
        keys = ", ".join(sorted(map(str, row))[:8]) or "none"
        raise _LineError(f"no key of a known format (found: {keys}): write {_ACCEPTED}")
    if len(found) > 1:
        raise _LineError(f"the line mixes the keys of {' and '.join(found)}: keep one format per line")
    if found[0] != "input_ids" and "labels" in row:
        raise _LineError('"labels" goes with "input_ids" (pre-tokenized lines); a '
                         f"{found[0]} line gets its labels from its turns: remove it")
    return found[0]


def _turn_list(row: Mapping[str, Any], key: str) -> list[str]:
    if key not in row:
        raise _LineError(f'an ERNIEKit SFT line needs both "src" and "tgt"; "{key}" is missing')
    value = row[key]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise _LineError(f'"{key}" must be a string or a non-empty list of strings, found {_short(value)}')
    return list(value)


def _sft_chat(row: Mapping[str, Any]) -> _Chat:
    src, tgt = _turn_list(row, "src"), _turn_list(row, "tgt")
    if "label" in row:
        labels = row["label"]
        if (not isinstance(labels, list)
                or not all(type(x) is int and x in (0, 1) for x in labels)):
            raise _LineError(f'"label" must be a list of 0 or 1 per turn (1: learn that answer), found '
                             f"{_short(labels)}")
    else:
        labels = [1] * len(src)
    if not len(src) == len(tgt) == len(labels):
        raise _LineError(f'{len(src)} "src" turns, {len(tgt)} "tgt" turns'
                         + (f', {len(labels)} "label" values' if "label" in row else "")
                         + ": each user turn needs one answer (and one label)")
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise _LineError(f'"system" must be a string, found {_short(system)}')
    if row.get("is_system") == 1:  # ERNIEKit: the first turn holds the system prompt
        system, src, tgt, labels = src[0], src[1:], tgt[1:], labels[1:]
        if not src:
            raise _LineError('"is_system": 1 makes the only turn the system prompt: the line has no '
                             "conversation; add a turn")
    return _chat(system, src, tgt, labels)


def _alpaca_chat(row: Mapping[str, Any]) -> _Chat:
    parts = {k: row.get(k) for k in ("instruction", "input", "output")}
    for key, value in parts.items():
        if key != "input" and key not in row:
            raise _LineError(f'an alpaca line needs "instruction" and "output"; "{key}" is missing')
        if value is not None and not isinstance(value, str):
            raise _LineError(f'"{key}" must be a string, found {_short(value)}')
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise _LineError(f'"system" must be a string, found {_short(system)}')
    user = (parts["instruction"] or "") + (parts["input"] or "")
    return _chat(system, [user], [parts["output"] or ""], [1])


def _chat(system: str | None, src: list[str], tgt: list[str], labels: list[int]) -> _Chat:
    for i, (q, a) in enumerate(zip(src, tgt, strict=True), 1):
        for what, text in (("user turn", q), ("answer", a)):
            if not text.strip():
                raise _LineError(f"{what} {i} is empty (ERNIEKit skips such examples): fill it in or "
                                 "remove the line")
    return _Chat(system, [(q.strip(), a.strip()) for q, a in zip(src, tgt, strict=True)], list(labels))


# -- chat turns as token ids -----------------------------------------------------------------------


class _ChatEncoder:
    """Cuts a conversation into header, prompt and answer ids with the tokenizer's chat template."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.eos = tokenizer.eos_token_id
        eos_sentence = tokenizer.token_to_id(END_OF_SENTENCE)
        self.eos_sentence = eos_sentence if eos_sentence != self.eos else None
        self.ends = {*tokenizer.stop_token_ids, *([eos_sentence] if eos_sentence is not None else [])}

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)

    def encode(self, chat: _Chat) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
        """(header ids, [(prompt ids, answer ids) per turn]); turn 1's prompt ids encode the header
        and its prompt as one text, as ERNIEKit's first turn does (the header ids alone stand
        before the kept turns when truncation drops turn 1)."""
        if not self.tok.chat_template:
            raise _LineError("SFT src/tgt data needs a chat template, and the tokenizer has none "
                             "(tokenizer_config.json chat_template, chat_template.jinja): add the model's "
                             'template, or give {"text": ...} or {"input_ids": [...]} lines')
        if self.eos is None:
            raise _LineError("the tokenizer names no EOS token (tokenizer_config.json eos_token): an answer "
                             "must end with one; add it to the tokenizer files")
        messages = [{"role": "system", "content": chat.system}] if chat.system is not None else []
        try:
            header = self.render(messages, False)
        except ErnieIRError:
            if messages:
                raise
            header = ""  # a template that cannot render an empty conversation has no header of its own
        previous, pieces = header, []
        for i, (user, answer) in enumerate(chat.turns, 1):
            messages.append({"role": "user", "content": user})
            prompt = self.render(messages, True)
            messages.append({"role": "assistant", "content": answer})
            full = self.render(messages, False)
            for before, after, what in ((previous, prompt, f"user turn {i} with the generation prompt"),
                                        (prompt, full, f"answer {i}")):
                if not after.startswith(before):
                    raise _LineError(f"the chat template does not render {what} as an extension of the "
                                     "conversation before it (it rewrites earlier text), so the example "
                                     "cannot be cut into prompt and answer: use a template that only "
                                     'appends, or give pre-tokenized {"input_ids", "labels"} lines')
            answer_text = full[len(prompt):]
            if not answer_text.strip():
                raise _LineError(f"the chat template renders answer {i} as nothing: it cannot be learned; "
                                 "check the template's assistant branch")
            pieces.append((prompt[len(previous):] if pieces else prompt, answer_text))
            previous = full
        enc = self.tok.encode
        turns = [(enc(p, add_special_tokens=False), self._ended(enc(a, add_special_tokens=False), self.eos))
                 for p, a in pieces]
        return enc(header, add_special_tokens=False), turns

    def _ended(self, ids: list[int], eos: int) -> list[int]:
        """`ids`, with the EOS id appended unless they end (whitespace tokens aside) with an end token."""
        k = len(ids)
        while k > 0 and ids[k - 1] not in self.ends and not self.tok.decode([ids[k - 1]]).strip():
            k -= 1
        return ids if k > 0 and ids[k - 1] in self.ends else [*ids, eos]

    def answer_labels(self, ids: list[int]) -> list[int]:
        """Labels of a learned answer: its ids, `<|end_of_sentence|>` as the EOS id (ERNIEKit)."""
        eos = self.eos
        if self.eos_sentence is None or eos is None:
            return list(ids)
        return [eos if t == self.eos_sentence else t for t in ids]


def _chat_row(encoder: _ChatEncoder, chat: _Chat, max_seq_len: int | None,
              ignore_index: int) -> tuple[list[int], list[int]]:
    header, turns = encoder.encode(chat)

    def tokens(first: int) -> int:  # the row's length keeping turns[first:] (turn 1 holds the header)
        return (len(header) if first else 0) + sum(len(p) + len(a) for p, a in turns[first:])

    first = 0
    if max_seq_len is not None:  # newest turns backwards while they fit; the header always stays
        first = len(turns)
        while first > 0 and tokens(first - 1) <= max_seq_len:
            first -= 1
        if first == len(turns):
            raise _LineError(f"the last turn needs {tokens(first - 1)} tokens with the template header, "
                             f"more than --max-seq-len {max_seq_len}: truncation would remove the whole "
                             "response; raise --max-seq-len or shorten the example")
    ids = list(header) if first else []
    labels = [ignore_index] * len(ids)
    learned_before = False
    for (prompt, answer), learn in zip(turns[first:], chat.labels[first:], strict=True):
        ids += prompt + answer
        # ERNIEKit's `+ 1`: a learned answer's end token also predicts the next prompt's first token
        head = prompt[:1]
        labels += encoder.answer_labels(head) if learned_before else [ignore_index] * len(head)
        labels += [ignore_index] * (len(prompt) - 1)
        labels += encoder.answer_labels(answer) if learn else [ignore_index] * len(answer)
        learned_before = bool(learn)
    if all(t == ignore_index for t in labels):
        dropped = (f" after truncation to the newest {len(turns) - first} of {len(turns)} turns"
                   if first else "")
        raise _LineError(f"nothing to learn: every answer{dropped} has label 0, so the loss mask is all "
                         "ignore; set a label to 1" + (" or raise --max-seq-len" if first else "")
                         + ", or remove the line")
    return ids, labels


# -- text and token-id lines -----------------------------------------------------------------------


def _text_row(tokenizer: Tokenizer, row: Mapping[str, Any], max_seq_len: int | None) -> tuple[list[int],
                                                                                              list[int]]:
    text = row["text"]
    if not isinstance(text, str):
        raise _LineError(f'"text" must be a string, found {_short(text)}')
    ids = tokenizer.encode(text)
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    ids = ids[:max_seq_len] if max_seq_len is not None else ids
    if len(ids) < 2:
        raise _LineError(f"the text is {len(ids)} token(s) long: a row needs >= 2 tokens to learn "
                         "anything; give more text or remove the line")
    return ids, list(ids)


def _ids_row(row: Mapping[str, Any], max_seq_len: int | None, ignore_index: int) -> tuple[list[int],
                                                                                         list[int]]:
    ids = row["input_ids"]
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise _LineError(f'"input_ids" must be a list of token ids (integers >= 0), found {_short(ids)}')
    labels = row.get("labels", ids)
    if (not isinstance(labels, list) or len(labels) != len(ids)
            or not all(type(t) is int and (t >= 0 or t == ignore_index) for t in labels)):
        raise _LineError(f'"labels" must be a list as long as "input_ids" ({len(ids)}) of token ids or the '
                         f"ignore index {ignore_index}, found {_short(labels)}")
    cut = max_seq_len is not None and len(ids) > max_seq_len
    ids, labels = (ids[:max_seq_len], labels[:max_seq_len]) if cut else (ids, labels)
    if len(ids) < 2:
        raise _LineError(f'"input_ids" holds {len(ids)} token(s): a row needs >= 2 tokens to learn anything')
    if all(t == ignore_index for t in labels[1:]):
        raise _LineError(f"every label after the first is the ignore index {ignore_index}"
                         + (f" after cutting to --max-seq-len {max_seq_len}" if cut else "")
                         + ": the line has nothing to learn; fix its labels or remove it")
    return list(ids), list(labels)


# -- the file --------------------------------------------------------------------------------------


def _parse(line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise _LineError(f"not valid JSON ({e.msg} at column {e.colno}): write one JSON object per "
                         f"line: {_ACCEPTED}") from None
    except RecursionError:
        raise _LineError("the line nests JSON too deeply: write one flat JSON object per line") from None
    except ValueError as e:  # an integer literal longer than int() converts
        raise _LineError(f"{_one_line(str(e).split(';')[0])}: token ids are small integers") from None
    if not isinstance(row, dict):
        raise _LineError(f"expected a JSON object, found a JSON {type(row).__name__}: write {_ACCEPTED}")
    return row


def read_sft_data(path: Path, tokenizer: Tokenizer | None, *, max_seq_len: int | None = None,
                  ignore_index: int = -100,
                  positions: int | None = None) -> list[tuple[list[int], list[int]]]:
    """The (input_ids, labels) rows of a fine-tuning JSON Lines file, one per example, in file order.

    `tokenizer`: the model's (None: only `{"input_ids": ...}` lines can be read). `max_seq_len`:
    the longest row (None: no limit); chats keep their newest turns, text and ids lines are cut.
    `ignore_index`: the label of every token that is not learned. `positions`: the model's (None:
    unbounded); without `max_seq_len` a longer row is refused (nothing is truncated unasked). The
    module docstring gives the formats and the label rule. Raises `SftDataError` (one line,
    `path:line`) for anything wrong.
    """
    p = Path(path)
    if max_seq_len is not None and (type(max_seq_len) is not int or max_seq_len < 2):
        raise SftDataError(f"--max-seq-len must be an integer >= 2, got {max_seq_len!r}")
    if tokenizer is not None and 0 <= ignore_index < tokenizer.vocab_size:
        raise SftDataError(f"--ignore-index {ignore_index} is a token id of the tokenizer's vocabulary "
                           f"[0, {tokenizer.vocab_size}): use a negative value such as -100")
    data = read_bytes(p, "fine-tuning data file", SftDataError)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise SftDataError(f"{p}:{line}: not UTF-8 text (byte {e.start}): fine-tuning data is JSON Lines "
                           "in UTF-8; re-export the file as UTF-8") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark some editors write
    encoder = _ChatEncoder(tokenizer) if tokenizer is not None else None
    rows: list[tuple[list[int], list[int]]] = []
    # JSON Lines ends a line at "\n" only (str.splitlines would also split at U+2028 inside a string)
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = _parse(line)
            kind = _format_of(row)
            if kind == "input_ids":
                rows.append(_ids_row(row, max_seq_len, ignore_index))
            elif tokenizer is None or encoder is None:
                raise _LineError(f"a {kind} line needs a tokenizer: the artifact has none; give "
                                 'pre-tokenized {"input_ids": [...], "labels": [...]} lines, or use a '
                                 "model whose folder has its tokenizer files")
            elif kind == "text":
                rows.append(_text_row(tokenizer, row, max_seq_len))
            else:
                chat = _sft_chat(row) if kind == "ERNIEKit SFT" else _alpaca_chat(row)
                rows.append(_chat_row(encoder, chat, max_seq_len, ignore_index))
            if max_seq_len is None and positions is not None and len(rows[-1][0]) > positions:
                raise _LineError(f"{len(rows[-1][0])} tokens, but the model has {positions} positions: "
                                 f"give --max-seq-len {positions} to truncate it, or split the example")
        except (_LineError, ErnieIRError) as e:
            raise SftDataError(f"{p}:{n}: {_one_line(str(e))}") from None
    if not rows:
        raise SftDataError(f"{p}: the file holds no examples (it is empty or blank): write one JSON object "
                           f"per line: {_ACCEPTED}")
    return rows
