"""The tokenizers of `rtrl model init-tiny`, made locally (no hub):

    char   one token per printable character, "role: content" chat lines: the demo's toy, where
           a letter is an action
    bpe    a byte-level BPE trained with Hugging Face `tokenizers` on text generated here (random
           words from syllables, chat turns, tool-call JSON), to a 32k-150k vocabulary like
           Qwen's or Llama's, with ChatML special tokens and a Jinja chat template in the
           Qwen2.5/Hermes convention: system, user, assistant and tool turns, tools offered in
           the system turn, assistant tool calls as `<tool_call>{json}</tool_call>`, tool results
           as `<tool_response>` inside a user turn

Both come back as a `PreTrainedTokenizerFast` that `save_pretrained` writes as tokenizer.json +
tokenizer_config.json, so a model directory loads through AutoTokenizer like a downloaded one.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterator
from typing import Any

# A chat template for tokenizers that have none: "role: content" lines, then the assistant cue.
SIMPLE_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# Qwen2.5's template (Apache-2.0), with one change: OpenAI-style arguments (a JSON string) are
# written as they are, not JSON-encoded a second time.
CHATML_TOOLS_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

TOKENIZERS = ("char", "bpe")


def char_tokenizer(tool_markers: bool = False) -> Any:
    """One token per printable character; with `tool_markers`, `<tool_call>` and `</tool_call>`
    are one token each, added after the characters (as Qwen2.5's tokenizer has them), so a char
    model writes a tool call's frame in two tokens instead of 23."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # one token per character, whitespace and newlines included
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if tool_markers:
        tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in ("<tool_call>", "</tool_call>")])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    return tokenizer


def bpe_tokenizer(vocab: int = 32_768, seed: int = 0) -> Any:
    """A byte-level BPE of `vocab` tokens (the three ChatML specials and the two tool-call
    markers included), trained on `_corpus(seed)`: same seed, same merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    markers = ["<tool_call>", "</tool_call>"]  # text the model writes: added, not special (decoded)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(markers),
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed, vocab), trainer)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    return tokenizer


def _corpus(seed: int, vocab: int) -> Iterator[str]:
    """Text to learn merges from: sentences of random syllable words (a lexicon about twice the
    vocabulary, so merges reach whole words), chat turns and tool-call JSON."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "qu", "str", "ng"]
    lexicon = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(2 * vocab)})
    words = lexicon + list(string.digits) + ["def", "return", "import", "print", "(", ")", "{", "}", ":", "="]
    for i in range(vocab + vocab // 4):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(5, 15)))
        if i % 7 == 0:
            call = {"name": rng.choice(lexicon), "arguments": {rng.choice(lexicon): rng.choice(lexicon)}}
            yield f"<|im_start|>assistant\n<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>\n"
        elif i % 7 == 1:
            yield f"<|im_start|>user\n<tool_response>\n{sentence}\n</tool_response><|im_end|>\n"
        else:
            yield f"<|im_start|>{rng.choice(['user', 'assistant', 'system'])}\n{sentence}<|im_end|>\n"
