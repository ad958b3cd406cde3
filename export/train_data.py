"""Training data for a DFlash drafter: the target's own greedy answers to a prompt set.

The prompt set is built offline from templates and from Python's standard library
(module docstrings to summarise and rewrite, small functions to document), covering chat,
code, math, lists, rewriting and summarising given text.  Answers are generated in
batches with a KV cache; each finished batch is appended to `sequences.jsonl`, so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import inspect
import json
import random
import time
from pathlib import Path

TOPICS = ["photosynthesis", "the water cycle", "black holes", "inflation", "vaccines", "the internet",
          "machine learning", "volcanoes", "democracy", "the immune system", "gravity", "climate change",
          "blockchain", "the Roman Empire", "electricity", "DNA", "sleep", "coffee", "the stock market",
          "renewable energy", "memory in computers", "compilers", "earthquakes", "the moon", "bees",
          "jazz", "chess", "recycling", "nutrition", "the French Revolution", "rainbows", "batteries"]
ACTIVITIES = ["learning a language", "running a marathon", "saving money", "working from home", "cooking rice",
              "writing an essay", "public speaking", "keeping plants alive", "travelling cheaply",
              "sleeping better", "studying for exams", "starting a garden", "reading more books"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
              "counts the words in a sentence", "merges two sorted lists", "removes duplicates from a list",
              "computes the average of a list of numbers", "finds the largest element in a list",
              "converts Celsius to Fahrenheit", "checks whether two strings are anagrams",
              "flattens a nested list", "returns the factors of a number", "sorts a list of tuples by the second item",
              "counts the vowels in a string", "computes the greatest common divisor of two numbers",
              "reads a text file and returns its lines", "capitalises every word in a sentence",
              "returns the sum of the digits of a number", "checks whether a year is a leap year",
              "transposes a matrix given as a list of lists"]
SQL_TASKS = ["lists the ten most recent orders in orders(id, customer_id, created_at)",
             "finds customers with no orders, given customers(id, name) and orders(id, customer_id)",
             "computes the average salary per department in employees(id, department, salary)",
             "counts the products in each category of products(id, category, price)"]
THINGS = ["fruits that are high in vitamin C", "programming languages", "European capitals", "musical instruments",
          "ways to reduce stress", "famous scientists", "board games", "healthy breakfast ideas", "mammals that live in the sea",
          "uses of a paperclip", "household chores", "sources of protein", "colours of the rainbow"]
REWRITES = ["Rewrite this in simpler words", "Rewrite this in a formal tone", "Summarize this text in two sentences",
            "Summarize this text in one sentence", "Give three key points of this text", "Rewrite this as a short list"]
STDLIB_MODULES = ["json", "csv", "collections", "itertools", "functools", "pathlib", "datetime", "random", "heapq",
                  "bisect", "textwrap", "string", "statistics", "fractions", "decimal", "zipfile", "tarfile", "gzip",
                  "shutil", "tempfile", "glob", "fnmatch", "argparse", "logging", "unittest", "doctest", "pprint",
                  "copy", "enum", "dataclasses", "contextlib", "abc", "typing", "hashlib", "hmac", "secrets",
                  "base64", "struct", "array", "queue", "threading", "sched", "calendar", "difflib", "html",
                  "urllib.parse", "email", "mimetypes", "sqlite3", "pickle", "shelve", "configparser", "uuid", "math"]


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in (text or "").split("\n\n") if 80 < len(" ".join(p.split())) < 700]


def _stdlib_texts() -> tuple[list[str], list[str]]:
    """Prose paragraphs from module docstrings, and short function sources."""
    import importlib

    prose, functions = [], []
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        prose += _paragraphs(module.__doc__)
        for _, obj in inspect.getmembers(module, inspect.isfunction):
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            prose += _paragraphs(obj.__doc__)[:1]
            try:
                source = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            lines = [line for line in source.splitlines() if not line.strip().startswith(("#", '"""', "'''"))]
            if 4 <= len(lines) <= 14 and '"""' not in source:
                functions.append("\n".join(lines))
    return prose, functions


def build_prompts(n: int = 800, seed: int = 0) -> list[dict]:
    """`n` chat prompts of every kind, deterministic for a seed."""
    rng = random.Random(seed)
    prose, functions = _stdlib_texts()
    makers = {
        "chat": lambda: rng.choice([f"What is {rng.choice(TOPICS)}?", f"Explain {rng.choice(TOPICS)} to a beginner.",
                                    f"Give me {rng.randint(3, 5)} tips for {rng.choice(ACTIVITIES)}.",
                                    f"Why is {rng.choice(TOPICS)} important?"]),
        "code": lambda: rng.choice([f"Write a Python function that {rng.choice(CODE_TASKS)}.",
                                    f"Write a SQL query that {rng.choice(SQL_TASKS)}.",
                                    f"Explain what this code does.\n\n{rng.choice(functions)}",
                                    f"Add a docstring to this function and return the full code.\n\n{rng.choice(functions)}"]),
        "math": lambda: _math_problem(rng),
        "list": lambda: f"List {rng.randint(3, 8)} {rng.choice(THINGS)}.",
        "grounded": lambda: f"{rng.choice(REWRITES)}.\n\n{rng.choice(prose)}",
    }
    kinds = list(makers)
    prompts = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        prompts.append({"id": f"t{i:05d}", "kind": kind, "messages": [{"role": "user", "content": makers[kind]()}]})
    return prompts


def _math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 40), rng.randint(2, 12), rng.randint(2, 9)
    return rng.choice([
        f"A shop sells {b} apples for {c} dollars. How much do {a * b} apples cost? Explain step by step.",
        f"What is {a} times {b} plus {c}? Show your work.",
        f"A train travels {a * 10} km in {b} hours. What is its average speed?",
        f"If a rectangle is {a} cm long and {b} cm wide, what are its area and perimeter?",
        f"Tom has {a} marbles and gives {c} to each of his {b % 5 + 2} friends. How many are left?",
    ])


def generate(source, prompts: list[dict], out: Path, max_new_tokens: int, batch: int, echo=print) -> Path:
    """Greedy answers of the target (a transformers model) to `prompts`, batched, resumable."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    path = out / "sequences.jsonl"
    done = set()
    if path.exists():
        done = {json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()}
    todo = [p for p in prompts if p["id"] not in done]
    tokenizer, model = source.tokenizer, source.model
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = model.generation_config.eos_token_id
    start, produced = time.perf_counter(), 0
    with path.open("a") as f:
        for i in range(0, len(todo), batch):
            rows = todo[i : i + batch]
            texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
                     for r in rows]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                output = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                        pad_token_id=tokenizer.pad_token_id)
            width = enc["input_ids"].shape[1]
            for r, ids, mask, new in zip(rows, enc["input_ids"], enc["attention_mask"], output[:, width:]):
                prompt = ids[mask.bool()].tolist()
                answer = new.tolist()
                ends = [k for k, t in enumerate(answer) if t in (eos if isinstance(eos, list) else [eos])]
                answer = answer[: ends[0] + 1] if ends else answer
                produced += len(answer)
                f.write(json.dumps({"id": r["id"], "kind": r["kind"], "prompt": prompt, "answer": answer}) + "\n")
            f.flush()
            rate = produced / (time.perf_counter() - start)
            left = len(todo) - i - len(rows)
            echo(f"  {len(done) + i + len(rows)}/{len(prompts)} prompts, {produced} new tokens, "
                 f"{rate:.0f} tok/s, ETA {left * (produced / (i + len(rows))) / max(rate, 1e-9) / 60:.0f} min")
    return path
