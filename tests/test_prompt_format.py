"""One prompt format for profiling and serving: the heads are profiled on needles probes and
served on the runtime's prompts, so for the same context and question both must be the same
token ids, split into context and question at the same token."""

from __future__ import annotations

import copy

import pytest
from transformers import ByT5Tokenizer

from needles import make_probe
from prompt_format import SEPARATOR, encode_prompt, render_prompt
from runtime.serve.generation import split_prompt


def _without_chat_template(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    return plain


def _context_of(tokenizer, probe) -> str:
    """The context text of ``probe``: its prompt decoded, from the context's first token to the
    separator before the question."""
    text = tokenizer.decode(probe.input_ids[probe.meta["context_start"] :])
    context, found, _ = text.rpartition("\n\n" + probe.question)
    assert found, text[-200:]
    return context


@pytest.mark.parametrize("chat_template", [True, False], ids=["chat-template", "no-chat-template"])
def test_runtime_prompt_is_the_probe_prompt(embedded_tokenizer, chat_template):
    tokenizer = embedded_tokenizer if chat_template else _without_chat_template(embedded_tokenizer)
    assert bool(tokenizer.chat_template) == chat_template
    for family, depth in (("retrieval", 40.0), ("comparison", 75.0), ("temporal", 10.0)):
        probe = make_probe(tokenizer, family, 512, depth, seed=5)
        context = _context_of(tokenizer, probe)
        head, tail = split_prompt(tokenizer, context, probe.question)
        assert head + tail == probe.input_ids, (
            family,
            tokenizer.decode(head + tail)[-80:],
            tokenizer.decode(probe.input_ids)[-80:],
        )
        assert len(head) == probe.context_end, family  # the same question-agnostic split


def test_plain_prompt_without_chat_template():
    tokenizer = ByT5Tokenizer()  # no chat template, no beginning-of-sequence token
    prompt = render_prompt(tokenizer, "Some context.", "Why?")
    assert prompt.text == "Some context.\n\nWhy?\nAnswer:"
    assert prompt.text[prompt.context_start :].startswith("Some context.")
    assert prompt.text[prompt.question_start :].startswith("Why?")
    ids, context_end = encode_prompt(tokenizer, "Some context.", "Why?")
    assert tokenizer.decode(ids[:context_end]).rstrip() == "Some context."
    assert tokenizer.decode(ids[context_end:]).lstrip() == "Why?\nAnswer:"


def test_plain_prompt_starts_with_bos_only_when_the_tokenizer_adds_it(embedded_tokenizer):
    plain = _without_chat_template(embedded_tokenizer)  # SmolLM2: bos_token set, never added
    assert plain.bos_token and plain("a")["input_ids"][0] != plain.bos_token_id
    assert render_prompt(plain, "Ctx.", "Q?").text == "Ctx.\n\nQ?\nAnswer:"
    plain.add_bos_token = True  # as Llama's tokenizer does
    assert render_prompt(plain, "Ctx.", "Q?").text == plain.bos_token + "Ctx.\n\nQ?\nAnswer:"
    ids, context_end = encode_prompt(plain, "Ctx.", "Q?")
    assert ids[0] == plain.bos_token_id and ids.count(plain.bos_token_id) == 1
    head, tail = split_prompt(plain, "Ctx.", "Q?")
    assert (head, tail) == (ids[:context_end], ids[context_end:])


def test_chat_template_prompt(embedded_tokenizer):
    content = "Ctx." + SEPARATOR + "Q?"
    direct = embedded_tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    ids, context_end = encode_prompt(embedded_tokenizer, "Ctx.", "Q?")
    assert ids == list(direct)
    assert "Q?" not in embedded_tokenizer.decode(ids[:context_end])
    # chat=False: the plain prompt even when the tokenizer has a template
    assert render_prompt(embedded_tokenizer, "Ctx.", "Q?", chat=False).text == "Ctx.\n\nQ?\nAnswer:"
    assert split_prompt(embedded_tokenizer, "Ctx.", "Q?", chat=False) == split_prompt(
        _without_chat_template(embedded_tokenizer), "Ctx.", "Q?"
    )


def test_chat_template_that_rewrites_the_message_is_refused(embedded_tokenizer):
    shouting = copy.deepcopy(embedded_tokenizer)
    shouting.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(ValueError, match="chat=False"):
        render_prompt(shouting, "Ctx.", "Q?")


def test_prompt_format_imports_only_the_standard_library():
    """Both the runtime and needles import it, so it must pull in neither (nor anything else)."""
    import ast
    import sys
    from pathlib import Path

    import prompt_format

    tree = ast.parse(Path(prompt_format.__file__).read_text())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    assert {name.split(".")[0] for name in names} <= set(sys.stdlib_module_names) | {"__future__"}, names
