"""edgespec demo: its answer checks, the model it picks, and its JSON."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edgespec.cli import demo
from edgespec.models import registry

GiB = 2**30

# The answer smollm2-135m gave (issue 33): every typo copied back.
COPIED = ("1. Recieve the package at the frunt door\n2. Seperate the papers by date\n"
          "3. Adress the envelopes to the new ofice\n4. Calender the meeting for next wensday\n"
          "5. Acknowlege every email before lunch")
FIXED = ("Here is the corrected list:\n\n1. Receive the package at the front door\n2. Separate the papers by "
         "date\n3. Address the envelopes to the new office\n4. Calendar the meeting for next Wednesday\n"
         "5. Acknowledge every email before lunch")


def test_the_spelling_check_passes_a_fixed_list_and_fails_a_copied_one():
    assert demo.check_spelling(FIXED) == (True, "every misspelling fixed")
    ok, why = demo.check_spelling(COPIED)
    assert not ok and "Recieve" in why
    ok, why = demo.check_spelling(FIXED.replace("Wednesday", "day"))
    assert not ok and "Wednesday" in why


def test_the_yaml_check_compares_data_not_text():
    right = ("```yaml\nname: edgespec\nversion: 0.1.0\nbackends:\n  - llama\n  - native\n  - onnx\n"
             "drafters:\n  ngram: true\n  model: true\n  recycle: false\nthreads: 2\ncontext: 4096\n```")
    assert demo.check_yaml(right)[0]
    assert not demo.check_yaml(right.replace("threads: 2", "threads: '2'"))[0]   # a string, not the number 2
    assert not demo.check_yaml("name: [unclosed")[0]


def test_the_rename_check_wants_the_same_program_with_the_parameter_renamed():
    renamed = "```python\n" + demo.MEAN.replace("values", "numbers") + "```"
    assert demo.check_rename(renamed) == (True, "the same program, its parameter renamed")
    also_loop = renamed.replace(" v ", " num ").replace("+= v", "+= num")   # a consistent renaming more
    assert demo.check_rename(also_loop)[0]
    assert demo.check_rename(demo.MEAN) == (False, "its parameter is values, not numbers")
    assert demo.check_rename(renamed.replace("return 0.0", "return 1.0")) == (False, "the code is not the same program")
    assert demo.check_rename(renamed.replace("count == 0", "total == 0")) == (False, "the code is not the same program")
    assert not demo.check_rename("def mean(:\n")[0]


@pytest.mark.parametrize("memory, bandwidth, want", [
    (24 * GiB, 40e9, "qwen2.5-coder-1.5b"),   # the development machine
    (4 * GiB, 20e9, "qwen2.5-coder-1.5b"),    # a laptop: 1.5B and its 0.5B draft fit
    (2 * GiB, 20e9, "qwen2.5-coder-0.5b"),    # too little memory for the 1.5B beside its draft
    (24 * GiB, 5e9, "qwen2.5-coder-0.5b"),    # the 1.5B would decode at ~4 tokens/s
    (512 * 2**20, 20e9, "smollm2-135m"),      # a small box
    (256 * 2**20, 0.5e9, "smollm2-135m"),     # nothing runs well: the smallest, said so
])
def test_the_default_chat_model_is_the_strongest_this_machine_runs_well(memory, bandwidth, want):
    name, why = registry.chat_model(memory, bandwidth)
    assert name == want
    assert ("smallest" in why) == (memory == 256 * 2**20)


def test_demo_json_names_the_model_and_each_answers_check(tiny_llama_path):
    """On a tiny random model every answer is wrong: each says so, and no best case is offered."""
    p = subprocess.run([sys.executable, "-m", "edgespec", "demo", "--model", str(tiny_llama_path), "--threads", "1",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["model"] == str(tiny_llama_path) and out["why"] == "named with --model"
    assert [r["label"] for r in out["prompts"]] == [d.label for d in demo.DEMO_PROMPTS]
    assert all(r["check"]["passed"] is False and r["check"]["why"] for r in out["prompts"])
    assert all(r["identical"] for r in out["prompts"])
    assert out["best"] is None
