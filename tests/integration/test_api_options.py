"""OpenAI request options through the real stack: each one changes the answer as the API says."""

from __future__ import annotations

import functools
from typing import Any

import openai
import pytest
import torch
from openai import OpenAI

from benchmarks.hf_chat import HfChat
from tests.media import data_url, make_image

MESSAGES = [{"role": "user", "content": "Write a few words about rivers and mountains."}]


def create(client: OpenAI, **options: Any) -> Any:
    extra = options.pop("extra_body", {})
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=options.pop("messages", MESSAGES),
        max_tokens=options.pop("max_tokens", 24),
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
        **options,
    )


def test_n_greedy_choices_are_identical_and_indexed(client: OpenAI) -> None:
    reply = create(client, n=3, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in reply.choices}) == 1
    assert reply.usage.completion_tokens == 3 * 24


def test_n_seeded_samples_differ_and_reproduce(client: OpenAI) -> None:
    first = create(client, n=2, temperature=1.0, seed=11)
    again = create(client, n=2, temperature=1.0, seed=11)
    other = create(client, n=2, temperature=1.0, seed=12)
    ids = [c.token_ids for c in first.choices]
    assert ids[0] != ids[1]
    assert ids == [c.token_ids for c in again.choices]
    assert ids != [c.token_ids for c in other.choices]


def test_n_streams_every_choice(client: OpenAI) -> None:
    stream = create(client, n=2, temperature=0, stream=True)
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts[0] == texts[1] != "" and finishes == {0: "length", 1: "length"}


def test_stop_strings_cut_the_text(client: OpenAI) -> None:
    free = create(client, temperature=0).choices[0].message.content
    stop = free[len(free) // 3 : len(free) // 3 + 4]
    assert stop.strip() and stop in free
    expected = free[: free.index(stop)]
    reply = create(client, temperature=0, stop=[stop, "\u2603never"])
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    streamed = create(client, temperature=0, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    kept = create(client, temperature=0, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == expected + stop  # (vLLM's option: the stop string is kept)


def test_top_logprobs_without_logprobs_is_refused(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        create(client, top_logprobs=3)
    with pytest.raises(openai.BadRequestError, match="n"):
        create(client, n=100)


@pytest.mark.parametrize("option", [{"top_k": 1}, {"top_p": 1e-6}, {"top_p": 0.0}, {"min_p": 1.0}])
def test_filters_that_keep_only_the_top_token_equal_greedy(client: OpenAI, option: dict[str, Any]) -> None:
    greedy = create(client, temperature=0).choices[0].token_ids
    sampled_free = create(client, temperature=1.0, seed=5).choices[0].token_ids
    top_p = option.pop("top_p", None)
    extra = option
    filtered = create(client, temperature=1.0, seed=5, extra_body=extra, **({} if top_p is None else {"top_p": top_p}))
    assert sampled_free != greedy  # so the equality below says the filter worked
    assert filtered.choices[0].token_ids == greedy


def test_logprobs_are_the_models_own(client: OpenAI, hf: HfChat) -> None:
    reply = create(client, temperature=0, logprobs=True, top_logprobs=3, max_tokens=4)
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    with torch.inference_mode():
        logits = hf.model(**hf.inputs(MESSAGES)).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)
    top = torch.topk(expected, 3)
    first = content[0]
    assert first.logprob == pytest.approx(float(expected[reply.choices[0].token_ids[0]]), abs=1e-4)
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert [t.token for t in first.top_logprobs] == [hf.tokenizer.decode([int(i)]) for i in top.indices]
    assert first.logprob == first.top_logprobs[0].logprob  # greedy chose the most likely token


def test_repetition_penalty_matches_transformers(client: OpenAI, hf: HfChat) -> None:
    inputs = hf.inputs(MESSAGES)
    with torch.inference_mode():
        out = hf.model.generate(**inputs, max_new_tokens=48, min_new_tokens=48, do_sample=False, repetition_penalty=3.0)
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    reply = create(client, temperature=0, max_tokens=48, extra_body={"repetition_penalty": 3.0})
    assert reply.choices[0].token_ids == expected
    assert expected != create(client, temperature=0, max_tokens=48).choices[0].token_ids  # it mattered


def test_logit_bias_matches_transformers(client: OpenAI, hf: HfChat) -> None:
    free = create(client, temperature=0, max_tokens=16).choices[0].token_ids
    # forbid the first token, discourage the second, favour one the answer never used
    unused = next(t for t in range(100, 1000) if t not in free)
    bias = {free[0]: -100, free[1]: -5, unused: 3}
    inputs = hf.inputs(MESSAGES)
    with torch.inference_mode():
        out = hf.model.generate(
            **inputs, max_new_tokens=16, min_new_tokens=16, do_sample=False,
            sequence_bias=[[[token], float(value)] for token, value in bias.items()],
        )  # fmt: skip
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    reply = create(client, temperature=0, max_tokens=16, logit_bias={str(t): v for t, v in bias.items()})
    assert reply.choices[0].token_ids == expected
    assert expected != free and free[0] not in expected  # it mattered


def test_options_that_change_nothing_here_are_accepted(client: OpenAI) -> None:
    plain = create(client, temperature=0, max_tokens=6).choices[0].token_ids
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    text = {"type": "text"}
    reply = create(client, temperature=0, max_tokens=6, tools=tools, tool_choice="none", response_format=text)
    assert reply.choices[0].token_ids == plain


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties_discourage_repeats(client: OpenAI, penalty: str) -> None:
    free = create(client, temperature=0, max_tokens=48).choices[0].token_ids
    assert len(set(free)) < len(free)  # the unpenalised answer repeats itself
    penalised = create(client, temperature=0, max_tokens=48, **{penalty: 2.0}).choices[0].token_ids
    assert penalised != free
    assert len(set(penalised)) > len(set(free))


def test_text_completions(client: OpenAI, hf: HfChat) -> None:
    prompt = "Once upon a time, in a land of rivers,"
    model = client.models.list().data[0].id
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    ids = hf.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = hf.model.generate(input_ids=ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    expected = hf.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    choice = reply.choices[0]
    assert reply.object == "text_completion" and choice.text == expected
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == ids.shape[1] and reply.usage.completion_tokens == 12
    assert len(choice.logprobs.token_logprobs) == 12 and all(len(t) == 2 for t in choice.logprobs.top_logprobs)
    sampled = client.completions.create(model=model, prompt=prompt, max_tokens=12, logprobs=0, seed=5,
                                        extra_body={"ignore_eos": True})  # fmt: skip
    given = sampled.choices[0].logprobs  # logprobs 0: the chosen token's, in top_logprobs too
    rows = zip(given.tokens, given.token_logprobs, given.top_logprobs, strict=True)
    assert all(top == {token: lp} for token, lp, top in rows)
    streamed = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    # max_tokens left out: OpenAI's default for this endpoint, 16 (not the context's 32k tokens)
    unset = client.completions.create(model=model, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert unset.usage.completion_tokens == 16 and unset.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=model, prompt=prompt, max_tokens=2, echo=True)


def test_an_empty_model_name_is_the_served_model(client: OpenAI) -> None:
    named = create(client, temperature=0, max_tokens=4).choices[0].token_ids
    reply = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert reply.choices[0].token_ids == named  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_continue_final_message_continues_the_assistant_text(client: OpenAI, hf: HfChat) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Rivers run down from the"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    reply = create(client, messages=messages, temperature=0, max_tokens=8, extra_body=options)
    text = hf.tokenizer.apply_chat_template(messages, chat_template=hf.chat_template, tokenize=False, **options)
    assert text.endswith("Rivers run down from the")  # (transformers' rendering: the turn left open)
    ids = hf.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = hf.model.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert reply.usage.prompt_tokens == ids.shape[1]
    assert reply.choices[0].token_ids == out[0, ids.shape[1] :].tolist()
    with pytest.raises(openai.BadRequestError, match="continue_final_message needs add_generation_prompt: false"):
        create(client, messages=messages, extra_body={"continue_final_message": True})


def test_special_tokens_are_shown_when_asked(client: OpenAI) -> None:
    im_start = 151644  # <|im_start|>: forced by logit_bias
    forced = {"logit_bias": {str(im_start): 100}, "max_tokens": 3, "temperature": 0}
    assert create(client, **forced).choices[0].message.content == ""
    shown = create(client, **forced, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].message.content == "<|im_start|>" * 3


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"echo": True}, "echo"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"best_of": 3}, "best_of"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ],
)
def test_vllm_options_that_cannot_be_honoured_are_refused(client: OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, max_tokens=2, extra_body=extra)
    assert caught.value.body["param"] == param  # type: ignore[index]


def test_chat_template_kwargs_reach_the_template(client: OpenAI, hf: HfChat) -> None:
    picture = data_url(make_image(56, 56, seed=3))
    content = [{"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": "What is this?"}]
    messages = [{"role": "user", "content": content}]
    plain = create(client, messages=messages, temperature=0, max_tokens=2)
    numbered = create(
        client, messages=messages, max_tokens=2, extra_body={"chat_template_kwargs": {"add_vision_id": True}}
    )
    # Qwen2-VL's template reads add_vision_id: "Picture 1: " before the image, as transformers renders it
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    render = functools.partial(hf.tokenizer.apply_chat_template, hf_messages, chat_template=hf.chat_template,
                               tokenize=False, add_generation_prompt=True)  # fmt: skip
    added = len(hf.tokenizer(render(add_vision_id=True))["input_ids"]) - len(hf.tokenizer(render())["input_ids"])
    assert added > 0 and numbered.usage.prompt_tokens == plain.usage.prompt_tokens + added


def test_text_completions_in_batches_and_as_token_ids(client: OpenAI, hf: HfChat) -> None:
    model = client.models.list().data[0].id
    texts = ["Once upon a time,", "The mountains were"]
    ids = [hf.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    one_by_one = [
        client.completions.create(model=model, prompt=t, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        for t in texts
    ]
    for prompt in (texts, ids):  # lm-eval-harness sends [[ids], ...]
        batch = client.completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0, n=2, extra_body={"ignore_eos": True}
        )
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert [c.text for c in batch.choices] == [r.choices[0].text for r in one_by_one for _ in range(2)]
        assert batch.usage.prompt_tokens == sum(len(i) for i in ids) and batch.usage.completion_tokens == 4 * 6
    single = client.completions.create(model=model, prompt=[ids[0]], max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert single.choices[0].text == one_by_one[0].choices[0].text
    with pytest.raises(openai.BadRequestError, match="prompt 1 is empty"):
        client.completions.create(model=model, prompt=["hi", ""], max_tokens=2)


def test_max_completion_tokens_and_unknown_fields(client: OpenAI) -> None:
    reply = create(client, temperature=0, max_tokens=None, max_completion_tokens=5, extra_body={"frobnicate": 1})
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
