"""Ollama's Go chat templates (a Modelfile's TEMPLATE) translated into Jinja:
the subset Ollama's simpler templates use renders as Go would; anything else
is refused naming the construct."""
from __future__ import annotations

import pytest

from edgespec.chat import template as chat_templates
from edgespec.chat.gotemplate import to_jinja
from edgespec.errors import InvalidArgumentError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}]


@pytest.mark.parametrize("go, want", [
    # Ollama's older kind: one turn at a time, the last cut at .Response
    ("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ if .Prompt }}<|im_start|>user\n"
     "{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n{{ .Response }}<|im_end|>\n",
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!"
     "<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"),
    ("[INST] {{ if .System }}<<SYS>>{{ .System }}<</SYS>>\n\n{{ end }}{{ .Prompt }} [/INST] {{ .Response }}",
     "[INST] <<SYS>>Be brief.<</SYS>>\n\nHi [/INST] Hello![INST] How are you? [/INST] "),
    # over .Messages, with trim markers and eq
    ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!"
     "<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"),
    ('{{- range .Messages }}{{ if eq .Role "user" }}U: {{ .Content }}\n{{ else if eq .Role "assistant" }}'
     "A: {{ .Content }}\n{{ else }}S: {{ .Content }}\n{{ end }}{{ end }}A: {{/* the answer */}}",
     "S: Be brief.\nU: Hi\nA: Hello!\nU: How are you?\nA: "),
    # Jinja's own markers in the text are text
    ("{% raw %} {{ .Prompt }}", "{% raw %} Hi{% raw %} How are you?"),
])
def test_the_subset_renders_as_go_would(go, want):
    assert chat_templates.render(to_jinja(go), CHAT) == want


@pytest.mark.parametrize("go, named", [
    ("{{ range $i, $m := .Messages }}{{ end }}", "range $i"),
    ("{{ .Tools }}", ".Tools"),
    ("{{ if .System }}x", "without its"),
    ("{{ len .Messages }}", "len .Messages"),
    ("{{ .Prompt | upper }}", "|"),
    ("", "empty"),
])
def test_anything_else_is_refused_naming_it(go, named):
    with pytest.raises(InvalidArgumentError, match="TEMPLATE") as e:
        to_jinja(go)
    assert named in str(e.value)
