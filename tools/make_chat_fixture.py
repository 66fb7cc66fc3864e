#!/usr/bin/env python3
"""Make flashtier-text's chat fixture and its transformers references.

Writes, into crates/flashtier-text/tests/fixtures/chat/ (or --out):

  tokenizer.json          a byte-level BPE (GPT-2 style ByteLevel pre-tokenizer
                          and decoder) trained here on the corpus below, with
                          exactly VOCAB_SIZE = 384 tokens: 256 byte tokens,
                          125 merges and the specials <|endoftext|>,
                          <|im_start|>, <|im_end|> (ids 381, 382, 383). A test
                          model with a 384-token vocabulary pairs with it.
  tokenizer_config.json   a ChatML chat template written for these tests, the
                          special tokens (eos <|im_end|>, pad <|endoftext|>,
                          bos null), clean_up_tokenization_spaces false
  generation_config.json  eos_token_id [<|im_end|>, <|endoftext|>]
  reference.json          what transformers itself renders, encodes and
                          decodes for the cases below, with the versions used

Run it in a throw-away venv; nothing of the venv is committed:

    python3 -m venv /tmp/chatvenv
    /tmp/chatvenv/bin/pip install transformers tokenizers jinja2
    /tmp/chatvenv/bin/python tools/make_chat_fixture.py

The tokenizer is trained deterministically (one thread), so a rerun with the
same versions rewrites the same files.
"""

import argparse
import json
import os
import platform
import sys

VOCAB_SIZE = 384
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# English prose and code, Chinese, Japanese, accented Latin and emoji, so
# that merges form inside multi-byte characters and characters span tokens.
CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat watches.",
    "A streaming decoder must never print half of a character to the user.",
    "The model reads its experts from flash and keeps the hot ones in memory.",
    "Tokens that decode with a leading space are common in byte-level BPE.",
    "What is the weather like in Paris today? It is sunny and warm.",
    "def greet(name):\n    return f\"Hello, {name}!\"\n",
    "for i in range(10):\n    print(i * i)\n",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
    "You are a helpful assistant. Answer briefly and truthfully.",
    "the the the and and and of of to to in in is is that that",
    "我们今天去公园散步，天气很好。",
    "中文分词和字节级编码的测试文本，包括标点符号。",
    "我的朋友喜欢喝茶，我喜欢喝咖啡。的的的是是是",
    "日本語のテキストもあります。こんにちは、世界！",
    "Café, naïve, façade, résumé, jalapeño, Zürich, Ångström.",
    "Emoji: 😀 😃 😄 🚀 🌍 ❤️ 👍🏽 🎉 and a family 👨‍👩‍👧.",
    "Rocket 🚀 to the moon 🌙, party 🎉 all night!",
    "Mixed: hello 世界 🌍 café 123 — done.",
    "Numbers 0123456789 and symbols ~!@#$%^&*()_+-=[]{}|;:'\",.<>/?",
    "   leading spaces, trailing spaces   \n\n\ttabs\tand\nnewlines\n",
]

# A ChatML template in the plain style that trim_blocks and lstrip_blocks
# shape: a default system turn, tools as JSON lines, reasoning kept only
# after the last user turn (a namespace found by a first loop), names on
# user turns, tool calls, and raise_exception for an unknown role.
MAIN_TEMPLATE = """\
{# flashtier-text fixture: ChatML with trim_blocks / lstrip_blocks whitespace #}
{% if messages[0]['role'] == 'system' %}
    {% set system_text = messages[0]['content'] | trim %}
    {% set turns = messages[1:] %}
{% else %}
    {% set system_text = 'You are a helpful assistant.' %}
    {% set turns = messages %}
{% endif %}
{% set ns = namespace(last_user=-1, calls=0) %}
{% for m in turns %}
    {% if m.role == 'user' %}
        {% set ns.last_user = loop.index0 %}
    {% endif %}
{% endfor %}
<|im_start|>system
{{ system_text }}
{% if tools %}

# Tools
<tools>
    {% for tool in tools %}
{{ tool | tojson }}
    {% endfor %}
</tools>
{% endif %}
<|im_end|>
{% for message in turns %}
    {% if message.role not in ['user', 'assistant', 'tool'] %}
        {{ raise_exception('Unknown role "' ~ message.role ~ '" at turn ' ~ loop.index) }}
    {% endif %}
    {% set content = message.content if message.content is string else '' %}
    {% if message.role == 'assistant' and content.startswith('<think>') %}
        {% set content = content.split('</think>')[-1] %}
    {% endif %}
<|im_start|>{{ message.role }}
    {% if message.role == 'user' and message.name is defined %}
{{ message.name }}: {{ content.strip() }}
    {% elif message.role == 'assistant' %}
        {% if loop.index0 > ns.last_user and message.reasoning_content is defined %}
<think>
{{ message.reasoning_content.strip() }}
</think>

        {% endif %}
{{ content.strip() }}
        {% for call in message.tool_calls | default([]) %}
            {% set ns.calls = ns.calls + 1 %}
            {% if loop.first and content.strip() %}

            {% endif %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
            {% if not loop.last %}

            {% endif %}
        {% endfor %}
    {% elif message.role == 'tool' %}
<tool_response>
{{ content }}
</tool_response>
    {% else %}
{{ content.strip() }}
    {% endif %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

# The same conversation shape in the other common style: every tag trimmed
# by hand with {%- -%} and {{- -}}, `is string` tests, structured content
# parts, and tojson with keyword arguments.
TRIMMED_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
    {%- if messages[0]['content'] is string %}
        {%- set system_text = messages[0]['content'] %}
    {%- else %}
        {%- set system_text = messages[0]['content'] | map(attribute='text') | join('') %}
    {%- endif %}
{%- else %}
    {%- set system_text = 'You are a helpful assistant.' %}
{%- endif %}
{{- '<|im_start|>system\\n' + system_text }}
{%- if tools %}
    {{- '\\n\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson(indent=2, sort_keys=true) }}
    {%- endfor %}
    {{- '\\n</tools>' }}
    {{- '\\nCompact: ' + (tools | tojson(separators=(',', ':'))) }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- continue %}
    {%- endif %}
    {%- if message['content'] is string %}
        {%- set text = message['content'] %}
    {%- elif message['content'] is none or message['content'] is not defined %}
        {%- set text = '' %}
    {%- else %}
        {%- set ns = namespace(parts=[]) %}
        {%- for part in message['content'] %}
            {%- if part['type'] == 'text' %}
                {%- set ns.parts = ns.parts + [part['text']] %}
            {%- endif %}
        {%- endfor %}
        {%- set text = ns.parts | join('\\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- if message.tool_calls is defined and message.tool_calls %}
        {%- for call in message.tool_calls %}
            {{- '<tool_call>' + call['function']['name'] + ' ' }}
            {%- for key, value in call['function']['arguments'].items() %}
                {{- key + '=' + value | tojson }}
                {%- if not loop.last %}{{- ', ' }}{%- endif %}
            {%- endfor %}
            {{- '</tool_call>' }}
        {%- endfor %}
    {%- endif %}
    {{- text | trim }}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# How Jinja2 prints values that are not strings: Python's str() of None,
# booleans, numbers, lists and dicts (single-quoted keys), and an undefined
# name as nothing.
PYREPR_TEMPLATE = """\
tools={{ tools }} documents={{ documents }} agp={{ add_generation_prompt }} bos=[{{ bos_token }}] eos=[{{ eos_token }}] pad=[{{ pad_token }}] unk=[{{ unk_token }}] missing=[{{ not_passed }}]
{% for message in messages %}
{{ loop.index }}/{{ loop.length }} {{ message }}
{% endfor %}
numbers={{ [1, 2.5, -0.0, 1e16, 1e-05, 123456789.125, true, none, 'it\\'s', "say \\"hi\\""] }}
json={{ {'b': 1, 'a': [1.0, 2.5e-07, 'é'], 'c': {'d': none}} | tojson }}
json_sorted={{ {'b': 1, 'a': [true, false]} | tojson(sort_keys=true) }}
json_ascii={{ 'é😀\\n\\t"' | tojson(ensure_ascii=true) }} json_raw={{ 'é😀' | tojson }}
json_indent0={{ {'a': [1, {'b': []}], 'e': {}} | tojson(indent=0) }}
json_indent_str={{ [1, [2]] | tojson(indent='--') }}
split={{ '  a  b c '.split() }} {{ 'a,b,,c'.split(',') }} strip=[{{ '  x y  '.strip() }}] lstrip=[{{ 'xxhixx'.lstrip('x') }}]
starts={{ 'hello'.startswith('he') }} {{ 'hello'.endswith('lo') }} {{ 'hello'.startswith(('x', 'h')) }}
items={% for k, v in {'z': 1, 'y': 2}.items() %}{{ k }}{{ v }}{% endfor %} get={{ {'k': 'v'}.get('k') }}/{{ {'k': 'v'}.get('q', 'dflt') }}
upper={{ 'MiXed'.upper() }} {{ 'MiXed'.lower() }} {{ 'hello world'.title() }} replace={{ 'a-b-c'.replace('-', '+') }}
"""

# Constructs that real model templates lean on, checked one by one: a
# content macro, selectattr/map/dictsort filters, reversed slices, loop
# neighbours, dict methods, arithmetic and slicing, conditional
# expressions without else, and Python printing of tuples and dicts.
FEATURES_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if 'image' in item or item.type == 'image' -%}<image>
            {%- elif 'text' in item -%}{{- item.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set systems = messages | selectattr('role', 'equalto', 'system') | list -%}
{%- set ns = namespace(last_query=messages | length - 1, seen=0) -%}
{%- for message in messages[::-1] -%}
    {%- set index = (messages | length - 1) - loop.index0 -%}
    {%- if message.role == 'user' and ns.seen == 0 -%}
        {%- set ns.last_query = index -%}
        {%- set ns.seen = 1 -%}
    {%- endif -%}
{%- endfor -%}
[systems={{ systems | length }} first={{ (messages | first).role }} last={{ (messages | last).role | upper }} last_query={{ ns.last_query }}]
{% for message in messages -%}
{%- set content = render_content(message.content) | trim -%}
{{ loop.index }}{% if loop.previtem is defined %}<{{ loop.previtem.role[:1] }}{% endif %}{% if loop.nextitem is defined %}>{{ loop.nextitem.role[:1] }}{% endif %} {{ message.role | capitalize }}: {{ content | replace('\\n', ' / ') }}
{%- if message.reasoning_content is string and loop.index0 > ns.last_query %} (thought: {{ message.reasoning_content.strip('\\n ') }}){% endif %}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
{%- set call = call.function if call.function is defined else call %}
 call {{ call.name }}({% for k, v in call.arguments | dictsort %}{{ k }}={{ v | tojson }}{{ ', ' if not loop.last }}{% endfor %})
{%- endfor %}
{%- endif %}
{%- if message.get('tool_call_id') %} [for {{ message.get('tool_call_id', 'none') }}]{% endif %}

{% endfor -%}
{%- if tools is not none %}tools: {{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}
{{ tools[0] | tojson(indent=4) }}
{% endif -%}
{{ 'keys=' ~ (messages[0] | list | join('+')) }} {{ 'count=' ~ messages | length }} {{ ('a', 'b') | join }} {{ [3, 1, 2] | sort | join(',') }} {{ 'x' * 3 }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 2 ** 10 }} {{ [1, 2, 3][1:] }} {{ 'abc'[::-1] }} {{ 'hello'[-1] }} {{ (1, 2) }} {{ {'a': 1, 'b': [none]} }} {{ none }} {{ 1.5 + 1 }} {{ 10 / 4 }} {{ 'q' in 'quiet' }} {{ messages[0].missing is defined }} {{ messages | map(attribute='role') | unique | list }}
{%- if add_generation_prompt %}
<|assistant|>
{%- endif %}
"""

# Tool schemas with keys in sorted order: serde_json without preserve_order
# sorts object keys, so the ordinary cases do not depend on that feature.
WEATHER_TOOL_SORTED = {
    "function": {
        "description": "Get the current weather in a city.",
        "name": "get_weather",
        "parameters": {
            "properties": {
                "city": {"description": "City name, e.g. 北京 or Zürich", "type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"], "type": "string"},
            },
            "required": ["city"],
            "type": "object",
        },
    },
    "type": "function",
}
# The same schema in the order an OpenAI client sends it (type first).
WEATHER_TOOL_CLIENT_ORDER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. 北京 or Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
CLOCK_TOOL_SORTED = {
    "function": {
        "description": "Current time; takes no arguments.",
        "name": "now",
        "parameters": {"properties": {}, "type": "object"},
    },
    "type": "function",
}

# Messages keep their keys in sorted-after-role order (role, content, then
# the rest alphabetically) for the same reason as the tools above.
CONVERSATIONS = [
    ("user_only", [{"role": "user", "content": "Hello there!"}], True),
    ("user_only_no_prompt", [{"role": "user", "content": "Hello there!"}], False),
    (
        "with_system",
        [
            {"role": "system", "content": "  You are terse.  \n"},
            {"role": "user", "content": "What is 2+2?"},
        ],
        True,
    ),
    (
        "multi_turn",
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Japan?"},
            {"role": "assistant", "content": "Tokyo."},
        ],
        False,
    ),
    (
        "unicode",
        [
            {"role": "user", "content": "你好，世界！🌍 Ça va? 👨‍👩‍👧"},
            {"role": "assistant", "content": "我很好 😀"},
            {"role": "user", "content": "日本語も話せますか？"},
        ],
        True,
    ),
    (
        "whitespace_content",
        [
            {"role": "user", "content": "\n\n   padded question \t \n"},
            {"role": "assistant", "content": "   padded answer   "},
            {"role": "user", "content": "   "},
        ],
        True,
    ),
    (
        "named_user_and_reasoning",
        [
            {"role": "user", "content": "Think first.", "name": "alice"},
            {
                "role": "assistant",
                "content": "<think>old thoughts</think>\n\nEarlier answer.",
                "reasoning_content": "dropped: before the last user turn",
            },
            {"role": "user", "content": "Again, please."},
            {
                "role": "assistant",
                "content": "Final answer.",
                "reasoning_content": "  kept: after the last user turn  ",
            },
        ],
        False,
    ),
    (
        "tool_round_trip",
        [
            {"role": "user", "content": "Weather in Paris and the time?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "function": {"arguments": {"city": "Paris"}, "name": "get_weather"},
                        "id": "call_1",
                        "type": "function",
                    },
                    {
                        "function": {"arguments": {}, "name": "now"},
                        "id": "call_2",
                        "type": "function",
                    },
                ],
            },
            {"role": "tool", "content": "{\"temp_c\": 21.5}", "tool_call_id": "call_1"},
            {"role": "tool", "content": "12:00", "tool_call_id": "call_2"},
        ],
        True,
    ),
    (
        "structured_content",
        [
            {"role": "system", "content": [{"text": "Be kind.", "type": "text"}]},
            {
                "role": "user",
                "content": [
                    {"text": "First part.", "type": "text"},
                    {"image_url": "file:///x.png", "type": "image"},
                    {"text": "Second part 🚀", "type": "text"},
                ],
            },
        ],
        True,
    ),
    (
        "unknown_role",
        [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "Once upon a time"}],
        True,
    ),
]

# (conversation name, template name, tools)
CHAT_CASES = [
    ("user_only", "main", None),
    ("user_only_no_prompt", "main", None),
    ("with_system", "main", None),
    ("multi_turn", "main", None),
    ("unicode", "main", None),
    ("whitespace_content", "main", None),
    ("named_user_and_reasoning", "main", None),
    ("tool_round_trip", "main", [WEATHER_TOOL_SORTED, CLOCK_TOOL_SORTED]),
    ("unknown_role", "main", None),
    ("user_only", "trimmed", None),
    ("with_system", "trimmed", None),
    ("multi_turn", "trimmed", None),
    ("unicode", "trimmed", None),
    ("whitespace_content", "trimmed", None),
    ("tool_round_trip", "trimmed", [WEATHER_TOOL_SORTED, CLOCK_TOOL_SORTED]),
    ("structured_content", "trimmed", None),
    ("multi_turn", "pyrepr", None),
    ("tool_round_trip", "pyrepr", None),
    ("unicode", "pyrepr", None),
    ("whitespace_content", "pyrepr", None),
    ("multi_turn", "features", None),
    ("tool_round_trip", "features", [WEATHER_TOOL_SORTED, CLOCK_TOOL_SORTED]),
    ("structured_content", "features", None),
    ("named_user_and_reasoning", "features", None),
    ("unicode", "features", None),
]

TEXT_CASES = [
    ("ascii", "Hello, world! The quick brown fox."),
    ("code", "def f(x):\n    return x * 2\n"),
    ("cjk", "我们今天去公园散步。"),
    ("japanese", "こんにちは、世界！"),
    ("emoji", "🚀🌍😀 👍🏽 👨‍👩‍👧"),
    ("mixed", "Mixed: hello 世界 🌍 café — done."),
    ("whitespace_runs", "a    b\t\t c\n\n\n   d  \n"),
    ("specials_inline", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"),
    ("unseen_chars", "Ωμέγα Привет ✓ ☃ 𝄞"),
    ("leading_space_words", " the the  cat"),
    ("empty", ""),
]


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    merges = VOCAB_SIZE - 256 - len(SPECIALS)
    trainer = trainers.BpeTrainer(
        vocab_size=256 + merges,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        sys.exit(f"trained vocabulary has {size} tokens, want {VOCAB_SIZE}: grow the corpus")
    return tok


def write_json(path, value):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=2)
        f.write("\n")


def cut_cases(hf):
    """Id sequences whose decoded prefixes end inside a character, as transformers decodes them."""
    cases = []
    for text in ["中文分词", "🚀🌍😀", "café ☃", "👨‍👩‍👧"]:
        ids = hf.encode(text, add_special_tokens=False)
        for cut in range(1, len(ids)):
            decoded = hf.decode(ids[:cut], skip_special_tokens=False)
            if decoded.endswith("\ufffd"):
                cases.append({"text": text, "ids": ids[:cut], "decode": decoded})
    # Byte tokens that can never start or continue a character (0xFF and
    # 0x80 are "ÿ" and "Ģ" in the byte-level alphabet), alone and before text.
    ff, cont = hf.convert_tokens_to_ids(["ÿ", "Ģ"])
    ok = hf.encode("ok", add_special_tokens=False)
    for ids in [[ff], [ff, ff], [cont, ff] + ok, ok + [cont]]:
        cases.append({"text": None, "ids": ids, "decode": hf.decode(ids, skip_special_tokens=False)})
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.join(here, "..", "crates", "flashtier-text", "tests", "fixtures", "chat")
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    import jinja2
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    tok = train_tokenizer()
    tok.save(os.path.join(out, "tokenizer.json"))
    vocab = tok.get_vocab()
    im_end, endoftext = vocab["<|im_end|>"], vocab["<|endoftext|>"]

    write_json(
        os.path.join(out, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "rstrip": False,
                          "normalized": False, "single_word": False, "special": True},
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
            "added_tokens_decoder": {
                str(vocab[s]): {"content": s, "lstrip": False, "rstrip": False,
                                "normalized": False, "single_word": False, "special": True}
                for s in SPECIALS
            },
            "chat_template": MAIN_TEMPLATE,
        },
    )
    write_json(
        os.path.join(out, "generation_config.json"),
        {"eos_token_id": [im_end, endoftext], "pad_token_id": endoftext},
    )

    hf = AutoTokenizer.from_pretrained(out)
    templates = {"main": None, "trimmed": TRIMMED_TEMPLATE, "pyrepr": PYREPR_TEMPLATE,
                 "features": FEATURES_TEMPLATE}
    conversations = {name: (msgs, agp) for name, msgs, agp in CONVERSATIONS}

    chat_cases = []
    for conv_name, template_name, tools in CHAT_CASES:
        messages, agp = conversations[conv_name]
        case = {
            "name": f"{conv_name}/{template_name}",
            "template": template_name,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": agp,
        }
        kwargs = dict(tools=tools, add_generation_prompt=agp, chat_template=templates[template_name])
        try:
            case["text"] = hf.apply_chat_template(messages, tokenize=False, **kwargs)
            case["ids"] = list(hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))
        except jinja2.exceptions.TemplateError as err:
            case["error"] = str(err)
        chat_cases.append(case)

    # One case that needs the tool schema's own key order kept end to end.
    ordered = {
        "name": "client_key_order/main",
        "template": "main",
        "needs_preserve_order": True,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER_TOOL_CLIENT_ORDER],
        "add_generation_prompt": True,
    }
    for tokenize, key in [(False, "text"), (True, "ids")]:
        rendered = hf.apply_chat_template(
            ordered["messages"], tools=ordered["tools"], tokenize=tokenize,
            add_generation_prompt=True, return_dict=False,
        )
        ordered[key] = rendered if key == "text" else list(rendered)
    chat_cases.append(ordered)

    text_cases = []
    for name, text in TEXT_CASES:
        ids = hf.encode(text, add_special_tokens=False)
        text_cases.append(
            {
                "name": name,
                "text": text,
                "ids": ids,
                "ids_with_specials": hf.encode(text, add_special_tokens=True),
                "decode": hf.decode(ids, skip_special_tokens=False),
                "decode_skip_special": hf.decode(ids, skip_special_tokens=True),
            }
        )

    write_json(
        os.path.join(out, "reference.json"),
        {
            "about": "made by tools/make_chat_fixture.py; transformers' own renders, encodings and decodings",
            "versions": {
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
                "jinja2": jinja2.__version__,
                "python": platform.python_version(),
            },
            "vocab_size": hf.vocab_size if hasattr(hf, "vocab_size") else len(hf),
            "len_tokenizer": len(hf),
            "special_tokens_map": hf.special_tokens_map,
            "eos_token_id": [im_end, endoftext],
            "templates": templates,
            "chat_cases": chat_cases,
            "text_cases": text_cases,
            "cut_cases": cut_cases(hf),
        },
    )
    print(f"wrote {out}: {len(chat_cases)} chat cases, {len(text_cases)} text cases")


if __name__ == "__main__":
    main()
