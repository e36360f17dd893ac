"""The small byte-level tokenizer (exact round trips, special ids, transformers loading) and `load_tokenizer`
on directories without tokenizer.json (the real K3 layout needs trust_remote_code). No network."""
import json

import pytest

from miles_k3.model.config import ConfigError
from miles_k3.model.tokenizer import (
    SMALL_TOKENIZER_SIZE,
    build_small_tokenizer,
    load_tokenizer,
    save_small_tokenizer,
    special_token_ids,
)

TEXTS = [
    "",
    "Hello, world!",
    "  two leading spaces, trailing tab\t",
    "line one\nline two\r\n\n",
    "Grüße, naïve café — ½ € ±",
    "中文，日本語のテキスト、한국어",
    "emoji 😀🚀👩‍👩‍👧 and flags 🇫🇷",
    "control \x00\x01\x7f and zero-width \u200b joiner",
    "math: ∑_{i=1}^n x_i ≤ √2",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_small_tokenizer(path, 512)
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_raw_tokenizer_round_trips_bytes(text):
    tok = build_small_tokenizer(512)
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))  # one id per byte, id = byte value
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_size():
    tok = build_small_tokenizer(SMALL_TOKENIZER_SIZE)
    assert tok.get_vocab_size() == SMALL_TOKENIZER_SIZE == 260
    assert special_token_ids() == {"[BOS]": 256, "[EOS]": 257, "[PAD]": 258, "<|end_of_msg|>": 259}
    assert tok.encode("[BOS]hi<|end_of_msg|>").ids == [256, 104, 105, 259]  # specials are atomic in text
    with pytest.raises(ConfigError, match="vocab_size=200.*260"):
        build_small_tokenizer(200)


def test_load_tokenizer_and_auto_tokenizer(tok_dir):
    from transformers import AutoTokenizer

    tok = load_tokenizer(tok_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    assert tok.convert_tokens_to_ids("<|end_of_msg|>") == 259 and len(tok) == 260
    auto = AutoTokenizer.from_pretrained(str(tok_dir))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8")), text  # no BOS added implicitly
        assert tok.decode(ids) == text and auto.decode(auto.encode(text)) == text
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=True) == "hi"
    generation = json.loads((tok_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 256, "eos_token_id": [259, 257], "pad_token_id": 258}


def test_remote_code_tokenizer_needs_opt_in(tmp_path):
    """A K3-style directory (tiktoken.model + tokenization_kimi.py, auto_map) fails before any code runs."""
    (tmp_path / "tiktoken.model").write_text("")
    (tmp_path / "tokenization_kimi.py").write_text("raise RuntimeError('remote code must not run')\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))
    with pytest.raises(ConfigError, match=r"model\.trust_remote_code=true"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()  # the code file alone is enough to refuse
    with pytest.raises(ConfigError, match=r"tokenization_kimi\.py.*model\.trust_remote_code=true"):
        load_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")
