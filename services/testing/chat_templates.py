"""Chat templates the tests and benchmarks serve with ``--chat-template``.

``SMOLLM2_TOOLS``: SmolLM2-135M-Instruct's own template (the same text for every chat
without tools), which also writes tools into the system turn, assistant tool calls and tool
results in the Hermes format that ``--tool-call-parser hermes`` reads (as Qwen2.5's
template does). SmolLM2's own template ignores tools.
"""

from __future__ import annotations

_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

SMOLLM2_TOOLS = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{%- else %}" + _DEFAULT_SYSTEM + "{%- endif %}"
    "{{ '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{%- endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + _DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not tools %}"
    "{{ '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{ message['content'] + '\\n' }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
