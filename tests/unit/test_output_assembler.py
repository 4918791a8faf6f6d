"""OutputAssembler with the real default-model tokenizer: finish reasons, stop strings, streaming."""

from __future__ import annotations

import pytest

from specmesh.engine.fetch import model_cache_dir
from specmesh.tokenization import OutputAssembler

MODEL_DIR = model_cache_dir()  # the default model ($SPECMESH_HOME or ~/.cache/specmesh)


@pytest.fixture(scope="module")
def tok():
    if not (MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip(f"default model not cached at {MODEL_DIR} (run `specmesh fetch-model`)")
    from specmesh.engine.loader import load_tokenizer

    return load_tokenizer(MODEL_DIR)


@pytest.fixture(scope="module")
def eos(tok) -> int:
    return tok.convert_tokens_to_ids("<|im_end|>")


def enc(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def assembler(tok, eos, max_tokens=1000, stop=()):
    return OutputAssembler(tok, max_tokens, {eos}, tuple(stop))


def feed(out: OutputAssembler, rounds: list[list[int]]):
    """Feed rounds; return (token deltas, text deltas), checking the streaming invariants each step."""
    tok_deltas, text_deltas = [], []
    for r in rounds:
        if out.finish_reason:
            break
        ids, text = out.add(r)
        tok_deltas.append(ids)
        text_deltas.append(text)
        streamed = "".join(text_deltas)
        assert "\ufffd" not in text or out.finish_reason, f"half-decoded character streamed: {text!r}"
        # streamed text is never retracted: it is always a prefix of the final text
        assert out.text.startswith(streamed), (streamed, out.text)
    return tok_deltas, text_deltas


def one_by_one(ids: list[int]) -> list[list[int]]:
    return [[t] for t in ids]


# ---------------------------------------------------------------------------------------- eos

def test_eos_finishes_and_keeps_eos_id(tok, eos):
    ids = enc(tok, "Hello there.")
    out = assembler(tok, eos)
    toks, texts = feed(out, [ids[:1], ids[1:] + [eos]])
    assert out.finish_reason == "eos"
    assert out.token_ids == ids + [eos]
    assert out.token_ids[-1] == eos
    assert out.text == "Hello there."  # the eos contributes no text
    assert "".join(texts) == out.text
    assert sum(toks, []) == out.token_ids


def test_tokens_after_eos_in_same_round_are_dropped(tok, eos):
    ids = enc(tok, "Yes")
    out = assembler(tok, eos)
    toks, texts = feed(out, [ids + [eos] + enc(tok, " and more")])
    assert out.finish_reason == "eos"
    assert out.token_ids == ids + [eos]
    assert toks == [ids + [eos]]
    assert out.text == "Yes" == "".join(texts)


def test_eos_as_first_token(tok, eos):
    out = assembler(tok, eos)
    ids, text = out.add([eos])
    assert out.finish_reason == "eos" and ids == [eos] and text == "" and out.text == ""


def test_no_finish_without_eos_length_or_stop(tok, eos):
    out = assembler(tok, eos, max_tokens=100)
    out.add(enc(tok, "Some words"))
    assert out.finish_reason is None


# ---------------------------------------------------------------------------------------- length

def test_max_tokens_truncates_round_and_finishes_length(tok, eos):
    ids = enc(tok, "one two three four five six seven eight")
    assert len(ids) >= 8
    out = assembler(tok, eos, max_tokens=5)
    toks, texts = feed(out, [ids[:3], ids[3:]])  # second round overshoots max_tokens
    assert out.finish_reason == "length"
    assert out.token_ids == ids[:5]
    assert toks == [ids[:3], ids[3:5]]
    assert out.text == tok.decode(ids[:5]) == "".join(texts)


def test_eos_exactly_at_max_tokens_is_eos(tok, eos):
    ids = enc(tok, "ok")
    out = assembler(tok, eos, max_tokens=len(ids) + 1)
    out.add(ids + [eos])
    assert out.finish_reason == "eos"


def test_max_tokens_one(tok, eos):
    ids = enc(tok, "Hello world")
    out = assembler(tok, eos, max_tokens=1)
    got, text = out.add(ids)
    assert out.finish_reason == "length" and got == ids[:1] and text == tok.decode(ids[:1])


def test_length_finish_releases_held_text(tok, eos):
    # text held back because it could grow into a stop string is released when the request ends
    ids = enc(tok, "The answer is ST")
    out = assembler(tok, eos, max_tokens=len(ids), stop=("STOP",))
    toks, texts = feed(out, one_by_one(ids))
    assert out.finish_reason == "length"
    assert "".join(texts) == out.text == "The answer is ST"


# ---------------------------------------------------------------------------------------- stop

def test_stop_string_cuts_text_and_tokens(tok, eos):
    ids = enc(tok, "The answer is STOP here and more")
    out = assembler(tok, eos, stop=("STOP",))
    toks, texts = feed(out, [ids])
    assert out.finish_reason == "stop"
    assert out.text == "The answer is "
    assert "".join(texts) == out.text
    # token_ids end exactly at the token that completed the stop string
    n = len(out.token_ids)
    assert "STOP" in tok.decode(out.token_ids)
    assert "STOP" not in tok.decode(out.token_ids[: n - 1])
    assert out.token_ids == ids[:n]
    assert toks == [out.token_ids]


def test_stop_completed_mid_token_keeps_that_token(tok, eos):
    # "OP h" ends inside the token " here": that token is kept, the text is cut before "OP h"
    ids = enc(tok, "The answer is STOP here and more")
    out = assembler(tok, eos, stop=("OP h",))
    feed(out, one_by_one(ids))
    assert out.finish_reason == "stop"
    assert out.text == "The answer is ST"
    assert tok.decode(out.token_ids).startswith("The answer is STOP h")
    assert "OP h" not in tok.decode(out.token_ids[:-1])
    assert out.token_ids == ids[: len(out.token_ids)]


def test_stop_string_spanning_two_rounds(tok, eos):
    ids = enc(tok, "The answer is STOP here")
    # find a split where the stop string straddles two rounds
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(("S", "ST", "STO"))
                 and "STOP" not in tok.decode(ids[:i]))
    out = assembler(tok, eos, stop=("STOP",))
    toks, texts = feed(out, [ids[:split], ids[split:]])
    assert out.finish_reason == "stop"
    assert texts[0] == "The answer is "[: len(texts[0])]
    assert not texts[0].endswith("S") and not texts[0].endswith("ST")  # partial stop string held back
    assert out.text == "The answer is " == "".join(texts)
    assert toks[0] == ids[:split]


def test_earliest_of_several_stop_strings_wins(tok, eos):
    ids = enc(tok, "alpha beta gamma delta")
    out = assembler(tok, eos, stop=("delta", "beta"))
    feed(out, [ids])
    assert out.finish_reason == "stop"
    assert out.text == "alpha "


def test_stop_string_beats_eos_and_length_in_same_round(tok, eos):
    ids = enc(tok, "x = 1\nEND\ny = 2")
    out = assembler(tok, eos, max_tokens=len(ids), stop=("END",))
    out.add(ids + [eos])
    assert out.finish_reason == "stop"
    assert out.text == "x = 1\n"
    assert eos not in out.token_ids


def test_no_partial_stop_string_leaks_while_streaming(tok, eos):
    text = "Item one. Item two. Item three. The end is near. Item four."
    ids = enc(tok, text)
    stop = ("The end",)
    out = assembler(tok, eos, stop=stop)
    toks, texts = feed(out, one_by_one(ids))  # feed() asserts streamed text is always a final-text prefix
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index("The end")]
    assert "".join(texts) == out.text


def test_stream_with_stop_never_ends_with_stop_prefix_while_unfinished(tok, eos):
    ids = enc(tok, "count: 1, 2, 3, 4, STOP, 5")
    out = assembler(tok, eos, stop=("STOP",))
    streamed = ""
    for t in ids:
        _, text = out.add([t])
        streamed += text
        if out.finish_reason:
            break
        for j in range(1, len("STOP")):
            assert not streamed.endswith("STOP"[:j]), streamed
    assert streamed == out.text == "count: 1, 2, 3, 4, "


def test_stop_that_never_matches(tok, eos):
    ids = enc(tok, "nothing to see here")
    out = assembler(tok, eos, max_tokens=len(ids), stop=("zebra",))
    toks, texts = feed(out, one_by_one(ids))
    assert out.finish_reason == "length"
    assert out.text == "nothing to see here" == "".join(texts)


def test_add_after_finish_is_a_no_op(tok, eos):
    ids = enc(tok, "a STOP b")
    out = assembler(tok, eos, stop=("STOP",))
    out.add(ids)
    before = (list(out.token_ids), out.text, out.finish_reason)
    got, text = out.add(enc(tok, " more"))
    assert got == [] and text == ""
    assert (out.token_ids, out.text, out.finish_reason) == before


# ---------------------------------------------------------------------------------------- streaming

@pytest.mark.parametrize("round_size", [1, 2, 3, 5])
def test_deltas_concatenate_to_final_text(tok, eos, round_size):
    text = "Speculative decoding drafts tokens, then the target verifies them in one pass."
    ids = enc(tok, text) + [eos]
    rounds = [ids[i:i + round_size] for i in range(0, len(ids), round_size)]
    out = assembler(tok, eos)
    toks, texts = feed(out, rounds)
    assert out.finish_reason == "eos"
    assert "".join(texts) == out.text == text
    assert sum(toks, []) == out.token_ids == ids


MULTIBYTE = "Hi 😀 and 🎉🎉 then 中文字符 ok 👍🏽 done"


def test_multibyte_split_across_tokens_exists(tok):
    # guard: the test below is only meaningful if some character spans several tokens
    ids = enc(tok, MULTIBYTE)
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))


@pytest.mark.parametrize("round_size", [1, 2])
def test_multibyte_characters_never_half_decoded(tok, eos, round_size):
    ids = enc(tok, MULTIBYTE) + [eos]
    rounds = [ids[i:i + round_size] for i in range(0, len(ids), round_size)]
    out = assembler(tok, eos)
    toks, texts = feed(out, rounds)
    for t in texts:
        assert "\ufffd" not in t
    assert "".join(texts) == out.text == MULTIBYTE


def test_multibyte_with_stop_string(tok, eos):
    text = "中文 😀 STOP 🎉"
    ids = enc(tok, text)
    out = assembler(tok, eos, stop=("STOP",))
    toks, texts = feed(out, one_by_one(ids))
    assert out.finish_reason == "stop"
    assert "".join(texts) == out.text == "中文 😀 "
    assert all("\ufffd" not in t for t in texts)


def test_multibyte_stop_string(tok, eos):
    text = "before 🎉 after"
    ids = enc(tok, text)
    out = assembler(tok, eos, stop=("🎉",))
    toks, texts = feed(out, one_by_one(ids))
    assert out.finish_reason == "stop"
    assert "".join(texts) == out.text == "before "
    assert "🎉" in tok.decode(out.token_ids) and "🎉" not in tok.decode(out.token_ids[:-1])


def test_special_tokens_are_not_in_text(tok, eos):
    start = tok.convert_tokens_to_ids("<|im_start|>")
    ids = [start] + enc(tok, "assistant\nhi")
    out = assembler(tok, eos)
    _, text = out.add(ids)
    assert "<|im_start|>" not in out.text
    assert out.token_ids == ids
