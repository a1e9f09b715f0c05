"""The reasoning split (`gateway.reasoning`): which templates think, and `<think>` text as reasoning_content."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.protocol import TokenDelta
from gateway.choice import ChoiceStream
from gateway.reasoning import (
    ReasoningSplitter,
    ThinkTokens,
    starts_thinking,
    think_tokens,
    thinking_template,
)
from workers.models import qwen3_vl_synth, synth

GENERATION = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
# Qwen3's hybrid style: no tag in the generation prompt unless thinking is off, when it is closed empty.
HYBRID_TEMPLATE = qwen3_vl_synth.CHAT_TEMPLATE.removesuffix(GENERATION) + (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
EOS = synth.SPECIAL_TOKENS["<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """The synthetic Qwen3-VL tokenizer (Qwen3's added tokens, `<think>` and `</think>` among them)."""
    out = tmp_path_factory.mktemp("qwen3-tokenizer")
    qwen3_vl_synth.write_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def tokens(tokenizer: PreTrainedTokenizerBase) -> ThinkTokens:
    found = think_tokens(tokenizer)
    assert found is not None
    return found


def _prompt(tokenizer: PreTrainedTokenizerBase, template: str, messages: list[dict], **variables: object) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True, **variables
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


HELLO = [{"role": "user", "content": "Hello"}]


def test_the_think_tags_are_single_added_tokens_that_survive_skip_special(
    tokenizer: PreTrainedTokenizerBase, tokens: ThinkTokens
) -> None:
    assert (tokens.start, tokens.end) == (qwen3_vl_synth.QWEN3_ADDED_TOKENS["<think>"], 151668)
    assert tokenizer.decode([tokens.end], skip_special_tokens=True) == "</think>"


def test_which_templates_think(tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    assert thinking_template(tokenizer, qwen3_vl_synth.THINKING_CHAT_TEMPLATE) is not None  # opens <think>
    assert thinking_template(tokenizer, HYBRID_TEMPLATE) is not None  # closes it empty with enable_thinking=false
    assert thinking_template(tokenizer, qwen3_vl_synth.CHAT_TEMPLATE) is None  # Instruct: the tags, no thinking
    synth.write_tokenizer(tmp_path)  # Qwen2-VL's vocabulary: no think tokens, whatever the template says
    qwen2 = AutoTokenizer.from_pretrained(str(tmp_path))
    assert think_tokens(qwen2) is None
    assert thinking_template(qwen2, qwen3_vl_synth.THINKING_CHAT_TEMPLATE) is None


def test_the_generation_prompt_says_where_the_answer_starts(
    tokenizer: PreTrainedTokenizerBase, tokens: ThinkTokens
) -> None:
    thinking = qwen3_vl_synth.THINKING_CHAT_TEMPLATE
    assert starts_thinking(_prompt(tokenizer, thinking, HELLO), tokens)
    assert not starts_thinking(_prompt(tokenizer, thinking, HELLO, enable_thinking=False), tokens)
    assert starts_thinking(_prompt(tokenizer, HYBRID_TEMPLATE, HELLO), tokens)  # the model opens it
    assert not starts_thinking(_prompt(tokenizer, HYBRID_TEMPLATE, HELLO, enable_thinking=False), tokens)
    # A closed block in the history does not count: only the last message's tokens do.
    history = [*HELLO, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHi"}, *HELLO]
    assert starts_thinking(_prompt(tokenizer, HYBRID_TEMPLATE, history), tokens)


def _stream(
    tokenizer: PreTrainedTokenizerBase, splitter: ReasoningSplitter, ids: list[int], chunk: int, stop: list[str]
) -> tuple[str, str, ChoiceStream]:
    """``ids`` through a real ChoiceStream ``chunk`` tokens at a time, each update through the splitter."""
    choice = ChoiceStream(0, "r", tokenizer, stop, reasoning=splitter)
    reasoning = content = ""
    for at in range(0, len(ids), chunk):
        piece = ids[at : at + chunk]
        last = at + chunk >= len(ids)
        delta = TokenDelta("r", piece, "stop" if last else None, prompt_tokens=3, completion_tokens=at + len(piece))
        update = choice.feed(delta)
        split = splitter.feed(update.text, update.token_ids, final=update.finish_reason is not None)
        if splitter.started_thinking:  # the closing tag itself is never sent
            assert "</think>" not in split.reasoning + split.content
        reasoning, content = reasoning + split.reasoning, content + split.content
    return reasoning, content, choice


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 100])
@pytest.mark.parametrize("stop", [[], ["zzzzzzzzzzzz"]])  # a long stop string holds text back: the tag splits
def test_streamed_split_matches_the_token_ids(
    tokenizer: PreTrainedTokenizerBase, tokens: ThinkTokens, chunk: int, stop: list[str]
) -> None:
    ids = tokenizer("Let me see: 2 and 2.\n</think>\n\nThe answer is 4.", add_special_tokens=False)["input_ids"]
    ids = [*ids, EOS]
    end = ids.index(tokens.end)
    reasoning, content, choice = _stream(tokenizer, ReasoningSplitter(tokens, True), ids, chunk, stop)
    assert reasoning == tokenizer.decode(ids[:end], skip_special_tokens=True) == "Let me see: 2 and 2.\n"
    assert content == tokenizer.decode(ids[end + 1 :], skip_special_tokens=True) == "\n\nThe answer is 4."
    message = ReasoningSplitter(tokens, True).message(choice.text, choice.token_ids)
    assert message == {"reasoning_content": reasoning, "content": content}


def test_a_tag_split_across_text_pieces_is_found(tokens: ThinkTokens) -> None:
    splitter = ReasoningSplitter(tokens, True)
    first = splitter.feed("abc</thi", [1, 2, tokens.end])  # the id came, its text only in part
    second = splitter.feed("nk>def", [3])
    assert (first.reasoning, first.content) == ("abc", "")
    assert (second.reasoning, second.content) == ("", "def")
    assert splitter.feed("g", [4]).delta() == {"content": "g"}


def test_an_answer_that_never_closes_the_thinking_is_all_reasoning(
    tokenizer: PreTrainedTokenizerBase, tokens: ThinkTokens
) -> None:
    ids = tokenizer("Still thinking about </thi", add_special_tokens=False)["input_ids"]  # cut by max_tokens
    reasoning, content, choice = _stream(tokenizer, ReasoningSplitter(tokens, True), ids, 2, [])
    assert (reasoning, content) == ("Still thinking about </thi", "")
    message = ReasoningSplitter(tokens, True).message(choice.text, choice.token_ids)
    assert message == {"reasoning_content": "Still thinking about </thi", "content": None}


def test_a_tag_spelled_in_ordinary_tokens_does_not_end_the_thinking(tokens: ThinkTokens) -> None:
    message = ReasoningSplitter(tokens, True).message("a</think>b", [10, 11, 12])  # no </think> token among them
    assert message == {"reasoning_content": "a</think>b", "content": None}


def test_the_models_own_think_tag_is_dropped(tokenizer: PreTrainedTokenizerBase, tokens: ThinkTokens) -> None:
    """Qwen3's hybrid templates: the model writes `<think>` itself."""
    ids = tokenizer("<think>\nhm</think>\n\nok", add_special_tokens=False)["input_ids"]
    for chunk in (1, 3, 100):
        reasoning, content, _ = _stream(tokenizer, ReasoningSplitter(tokens, True), ids, chunk, [])
        assert (reasoning, content) == ("\nhm", "\n\nok")


def test_enable_thinking_false_leaves_everything_content(
    tokenizer: PreTrainedTokenizerBase, tokens: ThinkTokens
) -> None:
    prompt = _prompt(tokenizer, qwen3_vl_synth.THINKING_CHAT_TEMPLATE, HELLO, enable_thinking=False)
    template = thinking_template(tokenizer, qwen3_vl_synth.THINKING_CHAT_TEMPLATE)
    assert template is not None
    ids = tokenizer("Plain answer</think>more", add_special_tokens=False)["input_ids"]
    reasoning, content, choice = _stream(tokenizer, template.splitter(prompt), ids, 2, [])
    assert (reasoning, content) == ("", "Plain answer</think>more")
    assert template.splitter(prompt).message(choice.text, choice.token_ids) == {
        "content": "Plain answer</think>more",
        "reasoning_content": None,
    }


def test_a_tool_call_inside_the_thinking_is_reasoning(tokenizer: PreTrainedTokenizerBase, tokens: ThinkTokens) -> None:
    text = 'maybe <tool_call>{"name": "f"}</tool_call>?</think>\n\n<tool_call>\n{"name": "g"}\n</tool_call>'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    message = ReasoningSplitter(tokens, True).message(tokenizer.decode(ids), ids)
    assert message["reasoning_content"] == 'maybe <tool_call>{"name": "f"}</tool_call>?'
    assert message["content"] == '\n\n<tool_call>\n{"name": "g"}\n</tool_call>'
