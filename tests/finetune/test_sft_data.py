"""Fine-tuning data (ernie_ir.finetune.sft_data) against ERNIEKit's loss mask written from REFERENCE.md 11.

The tokenizer is an ERNIE 4.5 one trained here (tests/frontends/test_tokenizer.py) with the
ERNIE chat template of REFERENCE 9.3: `<|begin_of_sentence|>`, system `{content}\\n`, user
`User: {content}\\n`, assistant `Assistant: {content}<|end_of_sentence|>`, generation prompt
`Assistant: `. `erniekit_rows` builds ERNIEKit's (tokens, labels, loss_mask) on ERNIEKit's own
shifted convention from those texts, without the module under test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from test_tokenizer import ERNIE_TEMPLATE, train_sentencepiece

from ernie_ir.finetune import END_OF_SENTENCE, PACKING_REFUSED, SftDataError, read_sft_data
from ernie_ir.frontends.tokenizer import Tokenizer, load_tokenizer
from ernie_ir.ir import ErnieIRError

X = -100
BOS_TEXT = "<|begin_of_sentence|>"


def _folder(root: Path, model: Path | None, **config: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if model is None:
        train_sentencepiece(root / "tokenizer.model", dummy_prefix=False)  # ERNIE's adds no dummy ▁
    else:
        shutil.copy(model, root / "tokenizer.model")
    base = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
            "pad_token": "<unk>", "unk_token": "<unk>", "cls_token": BOS_TEXT, "sep_token": END_OF_SENTENCE,
            "add_bos_token": False, "add_eos_token": False, "chat_template": ERNIE_TEMPLATE}
    base.update(config)
    (root / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in base.items() if v is not None}))
    (root / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    return root


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _folder(tmp_path_factory.mktemp("sft") / "ernie", None)


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    t = load_tokenizer(tok_dir)
    assert t is not None and t.eos_token_id == 2
    assert t.token_to_id(END_OF_SENTENCE) not in (None, 2)
    return t


def variant(tok_dir: Path, tmp_path: Path, **config: Any) -> Tokenizer:
    t = load_tokenizer(_folder(tmp_path / "variant", tok_dir / "tokenizer.model", **config))
    assert t is not None
    return t


def write(tmp_path: Path, *rows: Any, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows)
                    + "\n", encoding="utf-8")
    return path


# -- ERNIEKit, independently (REFERENCE.md 11) -----------------------------------------------------


def erniekit_rows(tok: Tokenizer, system: str | None, turns: list[tuple[str, str]], labels: list[int],
                  max_seq_len: int | None = None) -> dict[str, Any]:
    """ERNIEKit's SequenceDataset sequence for one example, on its shifted convention.

    Per turn `[0] * (len(src) - 1) + [label] * (len(tgt) + 1)` over `src + tgt` (turn 1's src holds
    the header and the system prompt); turns added from the newest backwards while they fit; the
    last token and its mask deleted; labels = tokens[1:] + [eos], `<|end_of_sentence|>` -> EOS.
    Two adaptations, both documented in sft_data: the budget is exact (header + kept turns <=
    max_seq_len, no 8-token reserve) and a truncated row starts with the whole header (ERNIEKit
    re-adds only its begin token). None if ERNIEKit skips the example.
    """
    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False)

    header = BOS_TEXT + (system + "\n" if system is not None else "")
    encoded = [(enc((header if i == 0 else "") + f"User: {q.strip()}\nAssistant: "),
                enc(a.strip() + END_OF_SENTENCE)) for i, (q, a) in enumerate(turns)]
    head = enc(header)
    budget = float("inf") if max_seq_len is None else max_seq_len
    tokens: list[int] = []
    mask: list[int] = []
    starts: list[int] = []  # where each kept turn starts, counted from the first kept turn
    i = len(encoded) - 1
    while i >= 0:
        src, tgt = encoded[i]
        if len(src) + len(tgt) + len(tokens) + (len(head) if i > 0 else 0) > budget:
            break
        tokens = src + tgt + tokens
        mask = [0] * (len(src) - 1) + [labels[i]] * (len(tgt) + 1) + mask
        starts = [0] + [s + len(src) + len(tgt) for s in starts]
        i -= 1
    if not tokens:
        return {"skipped": "no turn fits"}
    if i >= 0:  # left-truncated
        tokens, mask, starts = head + tokens, [0] * len(head) + mask, [s + len(head) for s in starts]
    last = tokens[-1]
    del tokens[-1], mask[-1]
    eos, eos_sentence = tok.eos_token_id, tok.token_to_id(END_OF_SENTENCE)
    ek_labels = [eos if t == eos_sentence else t for t in [*tokens[1:], eos]]
    if sum(mask) == 0:
        return {"skipped": "mask sums to 0"}
    return {"tokens": tokens, "labels": ek_labels, "mask": mask, "last": last, "starts": starts,
            "kept": len(turns) - 1 - i}


def ours_from_erniekit(ek: dict[str, Any]) -> tuple[list[int], list[int], set[int]]:
    """ERNIEKit's row in our convention: labels[j] = ERNIEKit's target of position j - 1 where its
    mask counts. Also returns the boundary positions: the first prompt token of a turn after a
    learned answer (that answer's end token predicts it; ERNIEKit's `+ 1`)."""
    ids = [*ek["tokens"], ek["last"]]
    labels = [X] + [lab if m else X for lab, m in zip(ek["labels"], ek["mask"], strict=True)]
    boundary = {s for s in ek["starts"][1:] if labels[s] != X}
    return ids, labels, boundary


CHATS = [  # (system, [(user, answer)], labels)
    (None, [("hello world", "hi there")], [1]),
    ("Be brief.", [("hello world", "hi"), ("the quick fox", "jumps over the lazy dog"),
                   ("模型推理", "量化 model")], [1, 0, 1]),
    (None, [("  graph compile  ", " run tensor "), ("User: who?", "Assistant: me"), ("你好", "世界 !")],
     [0, 1, 1]),
    ("", [("a", "b"), ("c", "d")], [1, 1]),
    ("System says: 中文 only.", [("123 4567", "3.14159"), ("why?", "because")], [0, 1]),
]


@pytest.mark.parametrize("k", range(len(CHATS)))
def test_labels_match_erniekit(tok: Tokenizer, tmp_path: Path, k: int) -> None:
    system, turns, labels = CHATS[k]
    row: dict[str, Any] = {"src": [q for q, _ in turns], "tgt": [a for _, a in turns], "label": labels}
    if system is not None:
        row["system"] = system
    [(ids, got)] = read_sft_data(write(tmp_path, row), tok)
    ek = erniekit_rows(tok, system, turns, labels)
    want_ids, want, boundary = ours_from_erniekit(ek)
    assert ids == want_ids
    assert got == want
    # ERNIEKit's `+ 1`: after each learned answer that another turn follows, the next prompt's
    # first token is a target too
    assert boundary == {s for s, learned in zip(ek["starts"][1:], labels, strict=False) if learned}
    assert all(got[s] == ids[s] for s in boundary)
    # besides those, exactly the answer tokens of label-1 turns (end token as EOS) are targets
    eos, eos_sentence = tok.eos_token_id, tok.token_to_id(END_OF_SENTENCE)
    targets = [t for j, t in enumerate(got) if t != X and j not in boundary]
    answers = [t for (_, a), learned in zip(turns, labels, strict=True) if learned
               for t in [*tok.encode(a.strip(), add_special_tokens=False), eos]]
    assert targets == answers
    assert ids[-1] == eos_sentence and got[-1] == eos


def test_truncation_keeps_newest_turns_and_header(tok: Tokenizer, tmp_path: Path) -> None:
    system, turns, labels = CHATS[1]
    full = erniekit_rows(tok, system, turns, labels)
    n = len(full["tokens"]) + 1
    row = {"system": system, "src": [q for q, _ in turns], "tgt": [a for _, a in turns], "label": labels}
    path = write(tmp_path, row)
    seen = set()
    for max_seq_len in range(n + 2, 8, -1):
        ek = erniekit_rows(tok, system, turns, labels, max_seq_len)
        if "skipped" in ek:
            with pytest.raises(SftDataError, match=r"data\.jsonl:1: the last turn needs .*raise "
                                                   "--max-seq-len or shorten the example"):
                read_sft_data(path, tok, max_seq_len=max_seq_len)
            seen.add(0)
            continue
        [(ids, got)] = read_sft_data(path, tok, max_seq_len=max_seq_len)
        want_ids, want, _ = ours_from_erniekit(ek)
        assert (ids, got) == (want_ids, want), max_seq_len
        assert len(ids) <= max_seq_len
        seen.add(ek["kept"])
        if ek["kept"] < len(turns):  # dropped turns: the header (with the system prompt) still leads
            header = tok.encode(BOS_TEXT + system + "\n", add_special_tokens=False)
            assert ids[:len(header)] == header
            assert tok.decode(ids).startswith(BOS_TEXT + system + "\nUser: " + turns[-ek["kept"]][0])
    assert seen == {0, 1, 2, 3}  # every truncation point was reached


def test_truncation_that_leaves_nothing_to_learn(tok: Tokenizer, tmp_path: Path) -> None:
    turns = [("hello world", "the quick brown fox jumps over the lazy dog"), ("why", "no")]
    path = write(tmp_path, {"src": [q for q, _ in turns], "tgt": [a for _, a in turns], "label": [1, 0]})
    [(ids, _)] = read_sft_data(path, tok)
    assert "skipped" in erniekit_rows(tok, None, turns, [1, 0], len(ids) - 1)  # only turn 2 fits: mask 0
    with pytest.raises(SftDataError, match=r"data\.jsonl:1: nothing to learn: every answer after truncation "
                                           r"to the newest 1 of 2 turns has label 0.*raise --max-seq-len"):
        read_sft_data(path, tok, max_seq_len=len(ids) - 1)


def test_alpaca_lines(tok: Tokenizer, tmp_path: Path) -> None:
    lines = [{"instruction": "Translate: ", "input": "你好", "output": "hello"},
             {"instruction": "say hi", "output": "hi", "system": "Be brief."},
             {"instruction": "no input", "input": None, "output": "ok"}]
    rows = read_sft_data(write(tmp_path, *lines), tok)
    cases = [(None, "Translate: 你好", "hello"), ("Be brief.", "say hi", "hi"), (None, "no input", "ok")]
    for (ids, got), (system, q, a) in zip(rows, cases, strict=True):
        want_ids, want, _ = ours_from_erniekit(erniekit_rows(tok, system, [(q, a)], [1]))
        assert (ids, got) == (want_ids, want)


def test_strings_lists_and_is_system(tok: Tokenizer, tmp_path: Path) -> None:
    a = read_sft_data(write(tmp_path, {"src": "hello", "tgt": "world"}), tok)
    b = read_sft_data(write(tmp_path, {"src": ["hello"], "tgt": ["world"], "label": [1]}, name="b.jsonl"),
                      tok)
    assert a == b
    # ERNIEKit's is_system: the first turn is the system prompt
    c = read_sft_data(write(tmp_path, {"src": ["Be brief.", "hello"], "tgt": ["ignored", "world"],
                                       "is_system": 1}, name="c.jsonl"), tok)
    d = read_sft_data(write(tmp_path, {"system": "Be brief.", "src": "hello", "tgt": "world"},
                            name="d.jsonl"), tok)
    assert c == d and c != a


def test_mixed_file_and_blank_lines(tok: Tokenizer, tmp_path: Path) -> None:
    path = write(tmp_path, {"text": "hello world"}, "", {"input_ids": [5, 6, 7]}, "  ",
                 {"src": "hi", "tgt": "ok"})
    rows = read_sft_data(path, tok)
    assert len(rows) == 3
    assert rows[1] == ([5, 6, 7], [5, 6, 7])


# -- text and token-id lines -----------------------------------------------------------------------


def test_text_lines(tok: Tokenizer, tok_dir: Path, tmp_path: Path) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    path = write(tmp_path, {"text": text})
    ids = tok.encode(text)
    [(got_ids, labels)] = read_sft_data(path, tok)
    assert got_ids == [*ids, 2] and labels == got_ids  # EOS appended, every token a target
    [(cut, cut_labels)] = read_sft_data(path, tok, max_seq_len=4)
    assert cut == ids[:4] and cut_labels == cut  # the tail is cut (and with it the EOS)
    # the tokenizer's BOS rule applies; an EOS the tokenizer already adds is not doubled
    both = variant(tok_dir, tmp_path, add_bos_token=True, add_eos_token=True)
    [(with_bos, _)] = read_sft_data(path, both)
    assert with_bos == [1, *ids, 2]
    # a tokenizer without a chat template still reads text (and input_ids) lines
    plain = variant(tok_dir, tmp_path / "plain", chat_template=None)
    assert read_sft_data(path, plain) == [(got_ids, labels)]


def test_input_ids_lines(tmp_path: Path) -> None:
    path = write(tmp_path, {"input_ids": [3, 4, 5, 6], "labels": [X, X, 5, 6]}, {"input_ids": [7, 8]})
    assert read_sft_data(path, None) == [([3, 4, 5, 6], [X, X, 5, 6]), ([7, 8], [7, 8])]
    assert read_sft_data(path, None, max_seq_len=3) == [([3, 4, 5], [X, X, 5]), ([7, 8], [7, 8])]
    assert read_sft_data(write(tmp_path, {"input_ids": [3, 4], "labels": [-1, 4]}, name="i.jsonl"), None,
                         ignore_index=-1) == [([3, 4], [-1, 4])]
    with pytest.raises(SftDataError, match=r"data\.jsonl:1: every label after the first is the ignore index "
                                           "-100 after cutting to --max-seq-len 2"):
        read_sft_data(path, None, max_seq_len=2)


def test_rows_feed_the_training_loop(tok: Tokenizer, tmp_path: Path) -> None:
    """The rows are what runtime's training data reader accepts and returns unchanged."""
    from ernie_ir.training.loop import _read_data

    system, turns, labels = CHATS[1]
    rows = read_sft_data(write(tmp_path, {"system": system, "src": [q for q, _ in turns],
                                          "tgt": [a for _, a in turns], "label": labels},
                               {"text": "hello world"}, {"input_ids": [1, 2, 3]}), tok)
    ids_file = write(tmp_path, *[{"input_ids": i, "labels": lab} for i, lab in rows], name="ids.jsonl")
    assert _read_data(ids_file, tok.vocab_size, max(len(i) for i, _ in rows)) == rows
    assert read_sft_data(ids_file, None) == rows  # token-id lines pass through


# -- templates and EOS -----------------------------------------------------------------------------


def test_answer_without_end_token_gets_eos(tok_dir: Path, tmp_path: Path) -> None:
    plain_chat = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant: {% endif %}")
    t = variant(tok_dir, tmp_path, chat_template=plain_chat)
    [(ids, labels)] = read_sft_data(write(tmp_path, {"src": "hello", "tgt": "world"}), t)
    prompt = t.encode("user: hello\nassistant: ", add_special_tokens=False)
    answer = [*t.encode("world\n", add_special_tokens=False), 2]  # "\n" trails the answer; EOS after it
    assert ids == prompt + answer
    assert labels == [X] * len(prompt) + answer
    # an answer the template ends with the EOS text keeps one EOS
    eos_chat = plain_chat.replace("{{ m['content'] }}", "{{ m['content'] }}{{ eos_token if m['role'] == "
                                  "'assistant' else '' }}")
    t2 = variant(tok_dir, tmp_path / "eos", chat_template=eos_chat)
    [(ids2, labels2)] = read_sft_data(write(tmp_path, {"src": "hello", "tgt": "world"}), t2)
    assert ids2 == prompt + t2.encode("world</s>\n", add_special_tokens=False)
    assert ids2.count(2) == 1 and labels2[len(prompt):] == ids2[len(prompt):]


def test_template_that_rewrites_earlier_turns(tok_dir: Path, tmp_path: Path) -> None:
    last_only = ("{% for m in messages %}{% if loop.last %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    t = variant(tok_dir, tmp_path, chat_template=last_only)
    with pytest.raises(SftDataError, match=r"data\.jsonl:1: the chat template does not render (user turn 1 "
                                           r"with the generation prompt|answer 1) as an extension"):
        read_sft_data(write(tmp_path, {"src": "hello", "tgt": "world"}), t)


def test_tokenizer_without_chat_template(tok_dir: Path, tmp_path: Path) -> None:
    t = variant(tok_dir, tmp_path, chat_template=None)
    path = write(tmp_path, {"input_ids": [5, 6]}, {"src": "hi", "tgt": "ok"})
    with pytest.raises(SftDataError, match=r"data\.jsonl:2: SFT src/tgt data needs a chat template.*"
                                           "tokenizer_config.json chat_template"):
        read_sft_data(path, t)


def test_no_tokenizer(tmp_path: Path) -> None:
    for row, kind in (({"text": "hi"}, "text"), ({"src": "hi", "tgt": "ok"}, "ERNIEKit SFT"),
                      ({"instruction": "hi", "output": "ok"}, "alpaca")):
        with pytest.raises(SftDataError, match=rf"data\.jsonl:2: a {kind} line needs a tokenizer: the "
                                               "artifact has none"):
            read_sft_data(write(tmp_path, {"input_ids": [1, 2]}, row), None)


def test_packing_refused_names_the_reason() -> None:
    assert "block-diagonal" in PACKING_REFUSED and "padded" in PACKING_REFUSED
    assert "\n" not in PACKING_REFUSED


# -- errors: one line naming path:line and the fix -------------------------------------------------

BAD_LINES = [
    ({"foo": 1}, r"no key of a known format \(found: foo\): write .*src.*instruction.*text.*input_ids"),
    ({"src": ["a", "b"], "tgt": ["c"]}, r'2 "src" turns, 1 "tgt" turns: each user turn needs one answer'),
    ({"src": ["a", "b"], "tgt": ["c", "d"], "label": [1]}, r'2 "src" turns, 2 "tgt" turns, 1 "label" values'),
    ({"src": "a", "tgt": "b", "label": [2]}, r'"label" must be a list of 0 or 1 per turn'),
    ({"src": "a", "tgt": "b", "label": [True]}, r'"label" must be a list of 0 or 1 per turn'),
    ({"src": "a", "tgt": "b", "label": 1}, r'"label" must be a list of 0 or 1 per turn'),
    ({"src": "a", "tgt": "b", "label": [0]}, r"nothing to learn: every answer has label 0"),
    ({"src": "a"}, r'needs both "src" and "tgt"; "tgt" is missing'),
    ({"src": [], "tgt": []}, r'"src" must be a string or a non-empty list of strings'),
    ({"src": [1], "tgt": ["b"]}, r'"src" must be a string or a non-empty list of strings'),
    ({"src": ["a", "  "], "tgt": ["b", "c"]}, r"user turn 2 is empty \(ERNIEKit skips such examples\)"),
    ({"src": "a", "tgt": ""}, r"answer 1 is empty"),
    ({"src": "a", "tgt": "b", "system": 3}, r'"system" must be a string'),
    ({"src": "a", "tgt": "b", "is_system": 1}, r'"is_system": 1 makes the only turn the system prompt'),
    ({"instruction": "a"}, r'an alpaca line needs "instruction" and "output"; "output" is missing'),
    ({"instruction": "a", "output": 5}, r'"output" must be a string'),
    ({"instruction": "", "output": "b"}, r"user turn 1 is empty"),
    ({"text": "a", "input_ids": [1, 2]}, r"the line mixes the keys of text and input_ids: keep one format"),
    ({"text": "a", "labels": [1]}, r'"labels" goes with "input_ids"'),
    ({"text": 5}, r'"text" must be a string'),
    ({"text": ""}, r"the text is 1 token\(s\) long"),
    ({"input_ids": [1, True]}, r'"input_ids" must be a list of token ids'),
    ({"input_ids": [1, -5]}, r'"input_ids" must be a list of token ids'),
    ({"input_ids": [1]}, r'"input_ids" holds 1 token\(s\)'),
    ({"input_ids": [1, 2], "labels": [1]}, r'"labels" must be a list as long as "input_ids" \(2\)'),
    ({"input_ids": [1, 2], "labels": [1, -7]}, r"or the ignore index -100"),
    ({"input_ids": [1, 2], "labels": [1, X]}, r"every label after the first is the ignore index -100"),
    ('{"src": "a", "tgt": ', r"not valid JSON \(Expecting value at column 21\)"),
    ("[1, 2]", r"expected a JSON object, found a JSON list"),
    ('"just a string"', r"expected a JSON object, found a JSON str"),
    ("[" * 100_000, r"nests JSON too deeply|not valid JSON"),
    ('{"input_ids": [1' + "0" * 5000 + "]}", r"token ids are small integers"),
]


@pytest.mark.parametrize("k", range(len(BAD_LINES)))
def test_bad_line(tok: Tokenizer, tmp_path: Path, k: int) -> None:
    bad, message = BAD_LINES[k]
    path = write(tmp_path, {"src": "hello", "tgt": "world"}, "", bad)
    with pytest.raises(SftDataError) as e:
        read_sft_data(path, tok)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(f"{path}:3: ")
    assert isinstance(e.value, ErnieIRError)
    assert re.search(message, text), text


def test_file_errors(tok: Tokenizer, tmp_path: Path) -> None:
    cases = [(b"", r"the file holds no examples"), (b"\n  \n\n", r"the file holds no examples"),
             (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r":2: not UTF-8 text \(byte 28\)")]
    for k, (data, message) in enumerate(cases):
        path = tmp_path / f"f{k}.jsonl"
        path.write_bytes(data)
        with pytest.raises(SftDataError, match=message) as e:
            read_sft_data(path, tok)
        assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)
    with pytest.raises(SftDataError, match="cannot read"):
        read_sft_data(tmp_path / "missing.jsonl", tok)
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(SftDataError, match="FIFO"):  # refused, not waited on
        read_sft_data(fifo, tok)


def test_option_errors(tok: Tokenizer, tmp_path: Path) -> None:
    path = write(tmp_path, {"text": "hello"})
    with pytest.raises(SftDataError, match="--max-seq-len must be an integer >= 2"):
        read_sft_data(path, tok, max_seq_len=1)
    with pytest.raises(SftDataError, match=r"--ignore-index 5 is a token id .*use a negative value"):
        read_sft_data(path, tok, ignore_index=5)


def test_json_lines_split_only_at_newline(tok: Tokenizer, tmp_path: Path) -> None:
    """U+2028 inside a JSON string is one line of JSON Lines (str.splitlines would cut it)."""
    path = tmp_path / "sep.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + '{"text": "a\u2028b"}\n', encoding="utf-8")
    rows = read_sft_data(path, tok)
    assert len(rows) == 2 and rows[1][0] == [*tok.encode("a\u2028b"), 2]
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # a UTF-8 byte-order mark is skipped
    assert read_sft_data(path, tok) == rows
