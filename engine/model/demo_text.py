"""The demo models' text: the chat templates (ChatML with tools; Qwen3's
thinking switch; Qwen2-VL's image placeholder) and the small corpus their
tokenizer is trained on (engine/model/demo_model.py). Data only."""

CHAT_TEMPLATE = """{{- bos_token -}}
{%- set ns = namespace(skip_first=false) -%}
{%- if tools -%}
<|im_start|>system
{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}

{% set ns.skip_first = true %}{% endif -%}
# Tools

You may call one or more functions. Their JSON schemas are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each call, return a JSON object with the function name and arguments inside <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if not (loop.first and ns.skip_first) -%}
{%- set content = message.content if message.content is not none else '' -%}
{%- if content is not string -%}
{%- set content = content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
{%- endif -%}
{%- if message.role in ['system', 'user'] -%}
<|im_start|>{{ message.role }}
{{ content }}<|im_end|>
{% elif message.role == 'assistant' -%}
<|im_start|>assistant
{{ content }}
{%- for call in message.tool_calls or [] -%}
{%- set tool_call = call.function if call.function is defined else call -%}
{%- if content or not loop.first %}{{ '\\n' }}{% endif -%}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {% if tool_call.arguments is string %}{{ tool_call.arguments }}{% else %}{{ tool_call.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor -%}
<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>tool
{% if message.name is defined and message.name %}[{{ message.name }}] {% endif %}{{ content }}<|im_end|>
{% else -%}
{{ raise_exception("demo chat template: unknown message role '" ~ message.role ~ "' (expected system, user, assistant or tool)") }}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""

# The thinking variant's template: the same, with Qwen3's switch at the end.
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("""{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
""", """{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif enable_thinking is defined and enable_thinking %}<think>
{% endif -%}
{% endif -%}
""")
assert THINKING_CHAT_TEMPLATE != CHAT_TEMPLATE

# The vision variant's template: image parts become Qwen2-VL's placeholder, which its
# processor widens to the image's tokens.
VISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- set content = content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}",
    "{%- set parts = namespace(text='') -%}{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{%- set parts.text = parts.text ~ part.text -%}"
    "{%- elif part.type in ['image', 'image_url'] -%}"
    "{%- set parts.text = parts.text ~ '<|vision_start|><|image_pad|><|vision_end|>' -%}"
    "{%- endif -%}{%- endfor -%}{%- set content = parts.text -%}")
assert VISION_CHAT_TEMPLATE != CHAT_TEMPLATE

CORPUS = r'''
The quick brown fox jumps over the lazy dog. A server that keeps running when one part
fails is more useful than a fast one that falls over. When the engine crashes, the
supervisor restarts it, and the gateway sends requests to the fallback until it is back.
Memory is the scarce resource on a laptop: a model that does not fit must be refused
before it is loaded, not after the machine starts to swap. Requests wait in a queue;
each one has a deadline, and a client that goes away should free its slot at once.
Tokens stream back one by one. The first token takes longest, because the prompt must
be processed; after that, every step is a small matrix product per layer.
Once upon a time, in a small village by the sea, there lived an old fisherman and his
daughter. Every morning they rowed out past the lighthouse, and every evening they came
home with silver fish, stories, and salt in their hair. "Tomorrow," she said, "we will
sail further than anyone has before." He laughed, but he did not say no.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. January, February,
March, April, May, June, July, August, September, October, November, December.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, hundred.
0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65536 3.14159 2.71828 1e-5 0x7f
Questions? Answers! Why not; because: it works -- mostly (see the notes [1], {2}).

def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]

class Queue:
    def __init__(self, capacity=8):
        self.items = []
        self.capacity = capacity

    def push(self, item):
        if len(self.items) >= self.capacity:
            raise RuntimeError("queue is full")
        self.items.append(item)

for i in range(10):
    print(f"step {i}: value={i * i}")

import json, os, sys
with open("config.json", "r", encoding="utf-8") as f:
    config = json.load(f)
return {"status": "ok", "model": config.get("model_type"), "tokens": 128}

{"role": "user", "content": "What is the weather in Paris?"}
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}

fn main() { let x: Vec<u32> = (0..10).collect(); println!("{:?}", x); }
SELECT id, name, created_at FROM users WHERE active = true ORDER BY name LIMIT 10;
$ curl -s http://127.0.0.1:8080/v1/chat/completions -H "Content-Type: application/json"
$ export PATH="$HOME/.local/bin:$PATH" && echo done
<html><body><p class="note">Hello, world!</p></body></html>

héllo wörld 你好 🙂 café naïve über façade señor Ærø smörgåsbord ñandú
Привет мир. こんにちは世界. 안녕하세요. Γειά σου Κόσμε. שלום עולם. مرحبا بالعالم
emoji: 🙂 😀 🚀 ✨ ❤️ 👍 — “quotes” ‘single’ … • € £ ¥ ° ± × ÷ → ← ✓
'''
