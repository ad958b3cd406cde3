"""Where training prompts come from.

- `magpie`: the target writes the request itself: it is given only the chat template's
  opening of a user turn (after the default system turn), sometimes with a first word or
  two, and samples the rest (the Magpie method).  Filtered and deduplicated.
- `template`: requests from fixed templates (chat, code, math, list).
- `grounded`: rewrite / summarise / explain a paragraph of offline text (see texts.py).
- `define`: explain a common English word (WordNet lemmas).
- `followup`: a second user turn after one of the target's own answers.

None of these templates or sources appear in the project's benchmark prompts
(bench/prompts/), so acceptance measured there is on prompts training never saw.
"""

from __future__ import annotations

import random
import re

from . import texts

# Openings of a user turn that steer the target's own requests towards a varied mix.
OPENINGS = ["", "", "", "", "", "", "How", "What", "Why", "Can you", "Write", "Explain", "I", "Please",
            "Give me", "List", "Create", "Describe", "Help me", "Summarize", "Tell me", "Compare", "Is it",
            "Write a Python", "How do I", "What is the difference between", "Suggest", "Plan", "Translate",
            "Calculate", "Solve", "Rewrite", "Generate", "Imagine", "My", "Should I", "Design"]

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
THINGS = ["fruits that are high in vitamin C", "programming languages", "European capitals", "musical instruments",
          "ways to reduce stress", "famous scientists", "board games", "healthy breakfast ideas",
          "mammals that live in the sea", "uses of a paperclip", "household chores", "sources of protein"]
INSTRUCTIONS = ["Rewrite this in simpler words", "Rewrite this in a formal tone", "Summarize this text in two sentences",
                "Summarize this text in one sentence", "Give three key points of this text",
                "Rewrite this as a short list", "Explain this to a beginner", "What is the main idea of this text?",
                "Write a question about this text, then answer it", "Explain what this means with an example"]
FOLLOWUPS = ["Can you give me an example?", "Explain that more simply.", "Summarize your answer in two sentences.",
             "Why is that?", "What are the downsides?", "Can you write that as a numbered list?",
             "Tell me more about the first point.", "How would I do that in practice?", "Thanks! Anything else I should know?",
             "Can you make it shorter?", "What is a common mistake people make here?", "Give me one more tip."]


def template_request(rng: random.Random) -> tuple[str, str]:
    """(kind, request) from the fixed templates."""
    kind = rng.choice(["chat", "code", "math", "list"])
    if kind == "chat":
        text = rng.choice([f"What is {rng.choice(TOPICS)}?", f"Explain {rng.choice(TOPICS)} to a beginner.",
                           f"Give me {rng.randint(3, 5)} tips for {rng.choice(ACTIVITIES)}.",
                           f"Why is {rng.choice(TOPICS)} important?"])
    elif kind == "code":
        functions = _functions()
        text = rng.choice([f"Write a Python function that {rng.choice(CODE_TASKS)}.",
                           f"Explain what this code does.\n\n{rng.choice(functions)}",
                           f"Add a docstring to this function and return the full code.\n\n{rng.choice(functions)}"])
    elif kind == "math":
        a, b, c = rng.randint(2, 40), rng.randint(2, 12), rng.randint(2, 9)
        text = rng.choice([f"A shop sells {b} apples for {c} dollars. How much do {a * b} apples cost? Explain step by step.",
                           f"What is {a} times {b} plus {c}? Show your work.",
                           f"A train travels {a * 10} km in {b} hours. What is its average speed?",
                           f"If a rectangle is {a} cm long and {b} cm wide, what are its area and perimeter?"])
    else:
        text = f"List {rng.randint(3, 8)} {rng.choice(THINGS)}."
    return kind, text


def _functions() -> list[str]:
    global _FUNCTIONS
    if _FUNCTIONS is None:
        _FUNCTIONS = texts.stdlib_functions()
    return _FUNCTIONS


_FUNCTIONS = None


def grounded_ref(rng: random.Random) -> dict | None:
    """A paragraph of offline text (by reference) and an instruction about it."""
    sources = [s for s in texts.SOURCES if texts.paragraphs(s)]
    if not sources:
        return None
    source = rng.choice(sources)
    return {"source": source, "index": rng.randrange(len(texts.paragraphs(source))),
            "instruction": rng.choice(INSTRUCTIONS)}


def grounded_text(ref: dict) -> str:
    paragraphs = texts.paragraphs(ref["source"])
    if ref["index"] >= len(paragraphs):
        raise ValueError(f"a row quotes paragraph {ref['index']} of {ref['source']}, which this machine does not have: "
                         f"install the offline texts (apt-get install {texts.PACKAGES})")
    return f"{ref['instruction']}.\n\n{paragraphs[ref['index']]}".replace("?.", "?")


def define_request(rng: random.Random) -> str | None:
    words = texts.wordnet_words()
    if not words:
        return None
    word = rng.choice(words)
    return rng.choice([f"What does the word '{word}' mean? Use it in a sentence.",
                       f"Explain the word \"{word}\" and give two examples of how it is used.",
                       f"Write a short paragraph that uses the word {word}."])


_WORD = re.compile(r"[a-z0-9]+")


def dedup_key(text: str) -> str:
    """Requests that open with the same ten words count as one."""
    return " ".join(_WORD.findall(text.lower())[:10])


def acceptable_request(text: str) -> bool:
    """A self-written request worth answering: a sentence or more, not a fragment or a loop."""
    words = text.split()
    if not 15 <= len(text) <= 600 or len(words) < 3 or "<|" in text:
        return False
    if len(set(words)) < 0.5 * len(words):
        return False
    lines = [l for l in text.splitlines() if l.strip()]
    return len(set(lines)) == len(lines)
