"""Tokenizers: the project's small byte-level tokenizer (for the tiny/medium configs: byte b is id b,
through the GPT-2 byte-to-unicode alphabet and a BPE model with no merges, so any UTF-8 text round-trips
exactly; the special tokens follow at 256.. with the K3 spellings) and one loader for every model directory: a
directory with `tokenizer.json` loads as a `transformers.PreTrainedTokenizerFast`; a real K3 directory
(tiktoken.model + tokenization_kimi.py, no tokenizer.json) loads through `AutoTokenizer` with its remote code,
which the user must opt into (`model.trust_remote_code=true`). transformers and tokenizers are imported lazily
(GPU hosts may lack them).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_k3.model.config import ConfigError

BOS, EOS, PAD, END_OF_MSG = "[BOS]", "[EOS]", "[PAD]", "<|end_of_msg|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, END_OF_MSG)  # ids 256, 257, 258, 259
NUM_BYTES = 256
SMALL_TOKENIZER_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)
TRUST_REMOTE_CODE_OPTION = "model.trust_remote_code=true"


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: printable bytes map to themselves, the others to U+0100, U+0101, ..."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(NUM_BYTES):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(NUM_BYTES + extra)
            extra += 1
    return mapping


def special_token_ids() -> dict[str, int]:
    """Ids of the small tokenizer's special tokens: {"[BOS]": 256, "[EOS]": 257, "[PAD]": 258, ...}."""
    return {tok: NUM_BYTES + i for i, tok in enumerate(SPECIAL_TOKENS)}


def build_small_tokenizer(vocab_size: int):
    """A byte-level `tokenizers.Tokenizer` of 260 tokens (bytes 0..255, then the special tokens).

    `vocab_size` is the model's embedding size; it must hold every token (ids beyond 259 are never produced).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < SMALL_TOKENIZER_SIZE:
        raise ConfigError(f"vocab_size={vocab_size}: the small byte-level tokenizer needs "
                          f"{SMALL_TOKENIZER_SIZE} ids (256 bytes + {len(SPECIAL_TOKENS)} special tokens); "
                          f"use a config with vocab_size >= {SMALL_TOKENIZER_SIZE}")
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size() == SMALL_TOKENIZER_SIZE
    assert all(tok.token_to_id(t) == i for t, i in special_token_ids().items())
    return tok


def save_small_tokenizer(directory: str | Path, vocab_size: int) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` into `directory`.

    Like K3, the tokenizer's eos is `[EOS]` while generation stops at `<|end_of_msg|>` (and `[EOS]`).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_small_tokenizer(vocab_size).save(str(directory / "tokenizer.json"))
    ids = special_token_ids()
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "additional_special_tokens": [END_OF_MSG],
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    gen_config = {"bos_token_id": ids[BOS], "eos_token_id": [ids[END_OF_MSG], ids[EOS]],
                  "pad_token_id": ids[PAD]}
    _write_json(directory / "tokenizer_config.json", tok_config)
    _write_json(directory / "generation_config.json", gen_config)


def small_tokenizer(vocab_size: int) -> Any:
    """The small byte-level tokenizer as a `transformers.PreTrainedTokenizerFast`: what `load_tokenizer` returns
    for a directory written by `save_small_tokenizer`, built in memory (models without a checkpoint)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=build_small_tokenizer(vocab_size), bos_token=BOS,
                                   eos_token=EOS, pad_token=PAD, additional_special_tokens=[END_OF_MSG],
                                   clean_up_tokenization_spaces=False)


def stop_token_ids(tokenizer: Any, model_dir: str | Path | None = None) -> list[int]:
    """Token ids that end a sample: `generation_config.json`'s eos_token_id in `model_dir` when it has one
    (K3 stops at its end-of-message token), else the tokenizer's eos and `<|end_of_msg|>` when it knows it."""
    if model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
        eos = json.loads((Path(model_dir) / "generation_config.json").read_text()).get("eos_token_id")
        if eos is not None:
            return sorted({int(e) for e in (eos if isinstance(eos, list) else [eos])})
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    end = tokenizer.convert_tokens_to_ids(END_OF_MSG)
    if isinstance(end, int) and end != tokenizer.unk_token_id:
        ids.add(end)
    return sorted(ids)


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a model directory, as a transformers tokenizer (encode / decode / convert ids).

    `tokenizer.json` present: `PreTrainedTokenizerFast`. Otherwise `AutoTokenizer` (real K3: tiktoken.model +
    tokenization_kimi.py), which runs the directory's code only when `trust_remote_code` is set.
    """
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: not a directory; pass the model directory that holds the tokenizer files")
    if (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    remote = _remote_code_reason(path)
    if remote and not trust_remote_code:
        raise ConfigError(f"{path}: the tokenizer is defined by code in the model directory ({remote}); "
                          f"it runs only if you opt in: set {TRUST_REMOTE_CODE_OPTION} (review the code "
                          "first)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise ConfigError(f"{path}: the tokenizer needs remote code; set {TRUST_REMOTE_CODE_OPTION} "
                              f"(transformers: {e})") from None
        raise


def _remote_code_reason(path: Path) -> str | None:
    """Why loading `path`'s tokenizer would run its code (auto_map entry or tokenization_*.py), or None."""
    config = path / "tokenizer_config.json"
    if config.is_file():
        try:
            auto_map = json.loads(config.read_text()).get("auto_map") or {}
        except (json.JSONDecodeError, AttributeError):
            auto_map = {}
        if isinstance(auto_map, dict) and "AutoTokenizer" in auto_map:
            return f"tokenizer_config.json auto_map.AutoTokenizer = {auto_map['AutoTokenizer']}"
    scripts = sorted(p.name for p in path.glob("tokenization_*.py"))
    return f"{', '.join(scripts)}" if scripts else None


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
