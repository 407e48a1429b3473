"""Tool-calling test material: a byte-level tokenizer (any text, so a grammar can make a random
model write JSON), chat templates written in the style of Qwen2.5 (Hermes ``<tool_call>``),
Llama 3.1 (JSON with "parameters", ``ipython`` results) and Mistral v3 (``[TOOL_CALLS] [...]``),
short but faithful to each format, and tiny random decoders exported with them."""

from __future__ import annotations

from pathlib import Path

# Added tokens, all special (as in the real tokenizers, except Qwen's <tool_call>, which is text
# here as there); ids 0.. in this order, then the 256 byte-level symbols.
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>", "[INST]", "[/INST]",
            "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]"]
VOCAB_SIZE = 288  # > 16 specials + 256 bytes + 6 merges: the logits' tail has ids the tokenizer lacks

QWEN_STYLE = """\
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{% endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{% endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{% endif %}
{%- for call in message.tool_calls %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- call.function.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{% endif %}"""

LLAMA_STYLE = """\
{%- set ns = namespace(first_user=-1) %}
{%- for message in messages %}
{%- if message.role == 'user' and ns.first_user < 0 %}{% set ns.first_user = loop.index0 %}{% endif %}
{%- endfor %}
{{- bos_token + '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n' }}{% endif %}
{{- 'Cutting Knowledge Date: December 2023\n\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{% endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'user' and tools and loop.index0 == ns.first_user %}
{{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
{{- 'Given the following functions, please respond with a JSON for a function call with its '
    'proper arguments that best answers the given prompt.\n\nRespond in the format {"name": '
    'function name, "parameters": dictionary of argument name and its value}. Do not use '
    'variables.\n\n' }}
{%- for tool in tools %}{{- tool | tojson(indent=4) + '\n\n' }}{% endfor %}
{{- message.content + '<|eot_id|>' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- for call in message.tool_calls %}
{{- '{"name": "' + call.function.name + '", "parameters": ' }}
{{- call.function.arguments | tojson }}{{- '}' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""

MISTRAL_STYLE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
{%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.index0 == ns.last_user %}
{{- '[AVAILABLE_TOOLS] [' }}
{%- for tool in tools %}{{- tool | tojson }}{% if not loop.last %}{{- ', ' }}{% endif %}{% endfor %}
{{- '][/AVAILABLE_TOOLS]' }}
{%- endif %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for call in message.tool_calls %}
{%- if call.id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}
{%- set out = call.function | tojson %}
{{- out[:-1] + ', "id": "' + call.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{% endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message.role == 'assistant' %}
{{- ' ' + message.content + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS] {"content": ' + message.content + ', "call_id": "' + message.tool_call_id }}
{{- '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""

TEMPLATES = {"hermes": QWEN_STYLE, "llama3_json": LLAMA_STYLE, "mistral": MISTRAL_STYLE}


# A few merges (byte-level symbols: "Ġ" is a space), so indented JSON is shorter and some tokens
# span JSON lexemes (a quote and a colon), as real vocabularies' do.
MERGES = [("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("ĠĠĠĠ", "ĠĠĠĠ"), ('"', ":"), ("Ġ", '"'), ('"', ",")]


def write_byte_tokenizer(path: Path) -> Path:
    """A byte-level BPE ``tokenizer.json``: ``SPECIALS``, one token per byte, then ``MERGES``,
    so every text encodes and every byte string decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(path))
    return path


def tool_decoder():
    """The tiny random decoder (PyTorch) the tool exports are made of: the byte-level
    vocabulary (bos ``<s>``, eos ``</s>``), 4096 positions (prompts with tools are long in bytes)."""
    from tfport.models import build_model
    from tfport.presets import get_preset

    config = get_preset("tiny-decoder").replace(
        vocab_size=VOCAB_SIZE, max_positions=4096, tie_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return build_model(config, seed=0)


def export_tool_decoders(root: Path) -> dict[str, Path]:
    """format name -> ``tool_decoder`` exported with that format's template and the byte-level
    tokenizer."""
    from tfport.export import ExportOptions, export_model

    tokenizer = write_byte_tokenizer(root / "byte-tokenizer.json")
    model = tool_decoder()
    paths = {}
    for name, template in TEMPLATES.items():
        paths[name] = root / f"tools-{name}"
        export_model(model, paths[name], ExportOptions(tokenizer=tokenizer, chat_template=template))
    return paths


_EXPORTED: dict[str, Path] = {}


def tool_exports(tmp_path_factory) -> dict[str, Path]:
    """``export_tool_decoders`` once per test process (the library and server tests share them)."""
    if not _EXPORTED:
        _EXPORTED.update(export_tool_decoders(tmp_path_factory.mktemp("tool-exports")))
    return _EXPORTED


# Tools whose arguments a random model can finish within a few dozen tokens under the grammar:
# bounded strings, integers and arrays, enums, booleans, nested objects, optional fields.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["celsius", "fahrenheit"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Book a table.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["guests", "when"],
                   "properties": {
                       "guests": {"type": "integer", "minimum": 1, "maximum": 12},
                       "when": {"type": "object", "additionalProperties": False,
                                "required": ["day", "hour"],
                                "properties": {"day": {"enum": ["mon", "tue", "wed"]},
                                               "hour": {"type": "integer", "minimum": 12,
                                                        "maximum": 22}}},
                       "terrace": {"type": "boolean"},
                       "notes": {"type": "array", "maxItems": 2,
                                 "items": {"type": "string", "maxLength": 4}}}}}}
TOOLS = [WEATHER, BOOK]
