"""Prompt templates: the built-ins' exact text, the chat template through a tokenizer, the registry's errors."""
import pytest

from miles_k3.evals import templates
from miles_k3.evals.templates import get_template, register_template, render_prompt, template_names

PROBLEM = "Find the remainder when $2^{10}$ is divided by 7."
BOXED = PROBLEM + "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
NO_CHAT = ("template 'chat' needs a tokenizer with a chat template; this tokenizer has none: use "
           "template=boxed")


class FakeTokenizer:
    """Records apply_chat_template's arguments and renders messages as <|role|>content<|end|>."""

    def __init__(self, chat_template="{{ messages }}"):
        self.chat_template = chat_template
        self.calls = []

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        self.calls.append((messages, tokenize, add_generation_prompt))
        text = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


def test_builtin_names():
    assert {"boxed", "plain", "chat", "chat_plain"} <= set(template_names())
    assert template_names() == sorted(template_names())


def test_boxed_and_plain_text():
    assert render_prompt("boxed", PROBLEM) == BOXED
    assert render_prompt("plain", PROBLEM) == PROBLEM
    assert render_prompt("plain", "  keeps\nspacing ") == "  keeps\nspacing "


def test_chat_uses_the_tokenizer_template_with_the_boxed_text():
    tok = FakeTokenizer()
    out = render_prompt("chat", PROBLEM, tok)
    assert out == f"<|user|>{BOXED}<|end|><|assistant|>"
    assert tok.calls == [([{"role": "user", "content": BOXED}], False, True)]


def test_chat_plain_sends_the_problem_as_it_is():
    tok = FakeTokenizer()
    own = "Solve it. The last line should be Answer: $Answer\n\n" + PROBLEM
    assert render_prompt("chat_plain", own, tok) == f"<|user|>{own}<|end|><|assistant|>"
    assert tok.calls == [([{"role": "user", "content": own}], False, True)]
    with pytest.raises(ValueError, match="template 'chat_plain' needs a tokenizer with a chat template.*"
                                         "use template=plain"):
        render_prompt("chat_plain", own, FakeTokenizer(chat_template=None))


@pytest.mark.parametrize("tok", [None, FakeTokenizer(chat_template=None), object()])
def test_chat_without_a_chat_template_says_use_boxed(tok):
    with pytest.raises(ValueError) as e:
        render_prompt("chat", PROBLEM, tok)
    assert str(e.value) == NO_CHAT


def test_chat_with_a_real_fast_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.models.WordLevel({"[UNK]": 0, "find": 1}, unk_token="[UNK]")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model), unk_token="[UNK]")
    with pytest.raises(ValueError, match="has none: use template=boxed"):
        render_prompt("chat", PROBLEM, tok)  # a fresh tokenizer has no chat template
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert render_prompt("chat", PROBLEM, tok) == f"<|user|>{BOXED}<|end|><|assistant|>"


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError) as e:
        get_template("fancy")
    assert str(e.value).startswith("template: 'fancy' is not one of ")
    assert all(name in str(e.value) for name in ("boxed", "chat", "plain"))
    with pytest.raises(ValueError, match="'fancy' is not one of"):
        render_prompt("fancy", PROBLEM)


def test_register_a_template_then_render_it(monkeypatch):
    monkeypatch.setattr(templates, "_TEMPLATES", dict(templates._TEMPLATES))

    @register_template("shout")
    def shout(problem, tokenizer):
        return problem.upper() + (" [tok]" if tokenizer is not None else "")

    assert "shout" in template_names() and get_template("shout") is shout
    assert render_prompt("shout", "abc") == "ABC"
    assert render_prompt("shout", "abc", FakeTokenizer()) == "ABC [tok]"
    with pytest.raises(ValueError, match="'shout' is already registered"):
        register_template("shout")(lambda p, t: p)
    assert get_template("shout") is shout


def test_registry_rejects_bad_names_and_non_text_results(monkeypatch):
    monkeypatch.setattr(templates, "_TEMPLATES", dict(templates._TEMPLATES))
    with pytest.raises(ValueError, match="non-empty string"):
        register_template("  ")
    register_template("ids")(lambda p, t: [1, 2, 3])
    with pytest.raises(TypeError, match="template 'ids' returned list, not a string"):
        render_prompt("ids", PROBLEM)


class _IdsTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        assert skip_special_tokens is False  # K3's answer channel is marked by special tokens
        return "".join({257: "[EOS]", 259: "<|end_of_msg|>"}.get(i, chr(i)) for i in ids)


@pytest.mark.parametrize("ids, finish, text", [
    ([54, 257], {"type": "stop", "matched": 257}, "6"),  # the stop token that ended it is not text
    ([54, 259], {"type": "stop", "matched": 259}, "6"),
    ([54, 257], {"type": "length", "matched": None}, "6[EOS]"),  # cut by the cap: every token is text
    ([54, 257], {"type": "stop", "matched": "6"}, "6[EOS]"),  # a stop string: nothing is dropped
    ([257, 54], {"type": "stop", "matched": 257}, "[EOS]6"),  # only a final matching token is dropped
    ([], {"type": "stop", "matched": 257}, ""),
])
def test_response_text_drops_only_the_final_stop_token(ids, finish, text):
    from miles_k3.evals.templates import response_text

    assert response_text(_IdsTokenizer(), {"output_ids": ids, "meta_info": {"finish_reason": finish}}) == text
