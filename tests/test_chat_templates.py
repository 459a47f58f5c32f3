"""Assistant loss masks for real chat templates (ChatML/SmolLM2, Llama-3.1, Qwen2.5) without generation markers."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from eagle_jax.training.chat import chat_ids_and_mask, end_of_turn_ids, pre_query
from eagle_jax.training.data import DataError, check_chat_template, encode_record
from workshop.tokenizer_build import train_tokenizer

# SmolLM2-135M-Instruct: ChatML with a default system prompt when the first message is not a system one.
SMOLLM2 = (
    r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou "
    r"are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + "
    r"message['role'] + "
    r"'\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
    r"'<|im_start|>assistant\n' }}{% endif %}"
)

# Llama-3.1 Instruct (meta-llama/Llama-3.1-8B-Instruct), tool parts included.
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501 (verbatim upstream template)

# Qwen2.5 Instruct (Qwen/Qwen2.5-7B-Instruct), tool parts included.
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501 (verbatim upstream template)

# Drops the reasoning of every assistant turn but the last (as reasoning models' templates do).
REWRITES_HISTORY = r"""{%- for m in messages %}
    {%- set content = m['content'] %}
    {%- if m['role'] == 'assistant' and not loop.last %}{%- set content = content.split('</think>')[-1] %}{%- endif %}
    {{- '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

TEMPLATES = {  # name: (template, its special tokens, the token that ends a turn)
    "smollm2": (SMOLLM2, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "llama3.1": (
        LLAMA31,
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        "<|eot_id|>",
    ),
    "qwen2.5": (QWEN25, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
}
DEFAULT_SYSTEM = {
    "smollm2": "named SmolLM",
    "llama3.1": "Cutting Knowledge Date",
    "qwen2.5": "You are Qwen, created by Alibaba Cloud.",
}

CORPUS = [
    "def add(a, b):\n    return a + b\n" * 10,
    "Hello there, how are you? Fine, thanks. The quick brown fox jumps over the lazy dog.\n" * 10,
    "You are a helpful assistant. Answer briefly.\n" * 10,
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Fine, thanks."}],
    [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Add two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "how are you?"},
        {"role": "assistant", "content": "The quick brown fox."},
    ],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello there, how are you?"},
        {"role": "user", "content": "Fine"},
        {"role": "assistant", "content": ""},  # an empty reply: just the end-of-turn token
        {"role": "user", "content": "lazy dog?"},
    ],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(CORPUS, vocab_size=320, out_dir=out)
    return out


def tokenizer_for(tok_dir, name: str):
    template, specials, _ = TEMPLATES[name]
    tok = AutoTokenizer.from_pretrained(tok_dir)  # eos <|end|>: not the templates' end-of-turn token
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    return tok


def masked_runs(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_mask_is_each_reply_and_its_end_of_turn(tok_dir, name):
    tok = tokenizer_for(tok_dir, name)
    end = TEMPLATES[name][2]
    check_chat_template(tok)
    for conv in CONVERSATIONS:
        s = encode_record({"messages": conv}, tok, "chats.jsonl:1")
        # The ids are exactly apply_chat_template's.
        assert s.input_ids.tolist() == tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
        want = [m["content"] + end for m in conv if m["role"] == "assistant"]
        assert [tok.decode(r) for r in masked_runs(s.input_ids, s.loss_mask)] == want
        rest = tok.decode(s.input_ids[s.loss_mask == 0])
        assert all(m["content"] in rest for m in conv if m["role"] != "assistant")  # system / user / headers unmasked
        if conv[0]["role"] != "system":
            assert DEFAULT_SYSTEM[name] in rest


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_pre_query_and_end_of_turn(tok_dir, name):
    tok = tokenizer_for(tok_dir, name)
    end = tok.convert_tokens_to_ids(TEMPLATES[name][2])
    assert end_of_turn_ids(tok) == {end, tok.eos_token_id}
    text = pre_query(tok)
    assert (
        DEFAULT_SYSTEM[name] in text
        and text == tok.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False)[: len(text)]
    )
    with_system = pre_query(tok, "Be terse.")
    assert "Be terse." in with_system and with_system.endswith(text[-8:])  # the same user header
    if name != "llama3.1":  # Llama-3.1 writes its date header with any system prompt
        assert DEFAULT_SYSTEM[name] not in with_system


def test_prefix_diffing_equals_the_generation_markers(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)  # the workshop template has {% generation %} markers
    for conv in CONVERSATIONS:
        ids_m, mask_m = chat_ids_and_mask(conv, tok, method="markers")
        ids_p, mask_p = chat_ids_and_mask(conv, tok, method="prefix")
        np.testing.assert_array_equal(ids_m, ids_p)
        np.testing.assert_array_equal(mask_m, mask_p)
        assert mask_p.sum() > 0


def test_template_that_rewrites_history_is_refused(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = REWRITES_HISTORY
    conv = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "<think>hmm</think>Fine."},
        {"role": "user", "content": "how are you?"},
        {"role": "assistant", "content": "<think>ok</think>Fine, thanks."},
    ]
    with pytest.raises(
        DataError, match=r"chats\.jsonl:7: turn 1 \(assistant\).*not a prefix.*renders earlier turns differently"
    ):
        encode_record({"messages": conv}, tok, "chats.jsonl:7")
    # The last turn alone is rendered like the whole conversation: single-turn records are fine.
    s = encode_record({"messages": conv[:2]}, tok, "chats.jsonl:8")
    assert [tok.decode(r) for r in masked_runs(s.input_ids, s.loss_mask)] == ["<think>hmm</think>Fine.<|im_end|>"]


def test_missing_template_and_slow_tokenizer_are_clear_errors(tok_dir):
    tok = tokenizer_for(tok_dir, "smollm2")

    class Slow:  # a tokenizer that gives no character offsets
        is_fast = False

        def __getattr__(self, name):
            return getattr(tok, name)

    with pytest.raises(DataError, match=r"f\.jsonl:2: .*slow \(Python\) tokenizer"):
        encode_record({"messages": CONVERSATIONS[0]}, Slow(), "f.jsonl:2")
    tok.chat_template = None
    with pytest.raises(DataError, match="has no chat_template"):
        check_chat_template(tok, "target")
    with pytest.raises(DataError, match="f.jsonl:3: has no chat_template"):
        encode_record({"messages": CONVERSATIONS[0]}, tok, "f.jsonl:3")
