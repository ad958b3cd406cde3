"""Recipe 2's wider requests: the kinds of things people ask a chat model, from templates of
this module's own (none of them is, or paraphrases, a benchmark prompt in bench/prompts/).

Recipe 1 (prompts.py) asks about a narrow set of topics in a few phrasings, and the drafter
trained on its answers is right more often on more of them but no longer on the benchmark's
held-out prompts (campaign/README.md, stop 34).  These spread over advice, code in many
languages and error messages, word problems, how-tos, explanations, role-play, creative
writing, and rewriting text the target wrote itself (a passage, then an instruction about it).
"""

from __future__ import annotations

import random

RELATIONS = ["sister", "coworker", "manager", "best friend", "teenage son", "upstairs neighbour", "partner",
             "flatmate", "father-in-law", "team lead", "classmate", "landlady"]
PROBLEMS = ["keeps borrowing money and never pays it back", "is always late when we meet",
            "talks over me in meetings", "wants us to move to another city", "forgot my birthday again",
            "asks me to cover their shifts every week", "keeps giving me advice I did not ask for",
            "never answers my messages", "takes credit for my work", "wants to adopt a second dog"]
PREPARATIONS = [("two weeks", "a job interview at a bank"), ("one evening", "my driving theory test"),
                ("three months", "a half marathon"), ("a weekend", "a presentation to the whole company"),
                ("a month", "a trip to Japan"), ("ten days", "my chemistry exam"), ("six weeks", "moving house"),
                ("a week", "my first day as a nurse")]
CHOICES = [("rent a flat", "buy one"), ("study in the morning", "study at night"), ("learn Spanish", "learn German"),
           ("buy a laptop", "buy a desktop computer"), ("pay off my student loan first", "start saving first"),
           ("take the train", "fly"), ("work for a start-up", "work for a large company"),
           ("run every day", "run three times a week")]
LANGUAGES = ["JavaScript", "TypeScript", "C", "C++", "Go", "Java", "Ruby", "PHP", "Rust", "Kotlin", "C#", "Python"]
FUNCTION_TASKS = ["checks whether a string is a palindrome", "returns the second largest number in an array",
                  "counts how often each word appears in a text", "converts a number of seconds to hh:mm:ss",
                  "validates an email address", "finds the longest common prefix of a list of strings",
                  "shuffles an array in place", "returns the n-th prime", "rotates an array by k positions",
                  "merges two dictionaries, summing the values of shared keys", "checks balanced brackets",
                  "converts a Roman numeral to an integer", "computes a running average", "chunks a list into pieces of size n"]
HOW_TOS = ["read a file line by line", "make an HTTP GET request", "sort a map by its values", "parse a JSON string",
           "get the current date and time", "split a string on commas", "run two tasks in parallel",
           "write a unit test", "format a number with two decimals", "read command-line arguments",
           "catch an exception and log it", "remove an item from a list while looping over it"]
ERRORS = ["TypeError: 'NoneType' object is not subscriptable", "IndexError: list index out of range",
          "SyntaxError: unexpected EOF while parsing", "ZeroDivisionError: division by zero",
          "ModuleNotFoundError: No module named 'requests'", "Uncaught ReferenceError: total is not defined",
          "Segmentation fault (core dumped)", "java.lang.NullPointerException", "fatal: not a git repository",
          "error[E0382]: borrow of moved value: `v`", "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff",
          "RecursionError: maximum recursion depth exceeded"]
SQL_TASKS = ["returns the ten customers with the most orders", "finds duplicate email addresses in a users table",
             "computes the average salary per department", "lists products that were never ordered",
             "counts sign-ups per month", "deletes rows older than one year from a log table"]
SHELL_TASKS = ["finds every file larger than 100 MB", "renames all .jpeg files in a folder to .jpg",
               "shows the ten largest folders in my home directory", "replaces a word in every .txt file",
               "prints the lines of a file that contain an email address", "compresses a folder into a tar.gz",
               "shows which process is using port 8080"]
NAMES = ["Maya", "Tom", "Aisha", "Lukas", "Priya", "Jonas", "Elena", "Sam", "Yuki", "Omar"]
HOWTO_TASKS = ["change a bike chain", "set up a new email account", "bake bread by hand", "clean a laptop keyboard",
               "back up my phone", "grow tomatoes on a balcony", "write a cover letter", "jump-start a car",
               "make a monthly budget", "descale a kettle", "make cold brew coffee", "tie a tie",
               "paint a wall", "train a puppy to sit", "start journaling"]
PROS_AND_CONS = ["electric cars", "a four-day work week", "online classes", "living in a big city",
                 "open-plan offices", "buying second-hand clothes", "working night shifts", "home schooling"]
GOALS = ["get fitter", "learn to cook simple meals", "read more", "spend less on food", "learn basic HTML",
         "sleep better", "declutter my flat"]
EXPLAIN_TOPICS = ["how vaccines train the immune system", "why the sea is salty", "how a refrigerator works",
                  "what an interest rate is", "how airplanes stay in the air", "what a neural network does",
                  "how tides work", "what a carbon footprint is", "how a bill becomes a law", "how GPS works"]
AUDIENCES = ["I am five", "I am twelve", "I am a university student", "I know nothing about science"]
HYPOTHETICALS = ["the moon disappeared", "everyone stopped using cash", "it never rained again",
                 "people could breathe under water", "the internet went down for a month", "cars could fly"]
PHENOMENA = ["cats purr", "leaves change colour in autumn", "we dream", "onions make us cry",
             "planes leave white trails", "bread goes stale", "we get hiccups", "the sky turns red at sunset"]
PAIRS = [("weather", "climate"), ("a virus", "a bacterium"), ("RAM", "storage"), ("a loan", "a mortgage"),
         ("baking soda", "baking powder"), ("a lake", "a pond"), ("affect", "effect"), ("a stock", "a bond")]
ROLES = ["a travel guide in Lisbon", "a personal trainer", "a librarian", "a chef in a small restaurant",
         "a history teacher", "a support agent for an internet provider", "a museum guide", "a gardener"]
ROLE_ASKS = ["Introduce yourself and ask me two questions.", "What would you recommend to a beginner?",
             "Describe a typical day at your job.", "What is the most common question people ask you?"]
FORMS = ["short poem", "limerick", "haiku", "story of five sentences", "diary entry", "dialogue between two friends",
         "song chorus", "fable with a moral"]
SUBJECTS = ["a lost umbrella", "the first day of spring", "a robot learning to cook", "a quiet train station",
            "an old lighthouse", "a cat that hates Mondays", "a city at night", "a forgotten birthday"]

# Passages the target writes, to be rewritten in a later request of the same round.
PASSAGE_RECIPIENTS = ["my team", "a hotel", "my teacher", "a customer", "the neighbours", "a plumber"]
PASSAGE_SUBJECTS = ["a delayed project", "changing a booking", "a missed class", "a refund", "a street party",
                    "a leaking pipe", "a late delivery", "a new office rule"]
REVIEWED = ["a pair of running shoes", "a cheap blender", "a coffee shop", "a fantasy novel", "a phone charger",
            "a hotel room", "a language-learning app", "a pizza place"]
ANNOUNCED = ["a library closing early", "a new bus timetable", "a charity run", "a school concert",
             "new office hours", "a water outage on Friday"]
PLACES = ["a busy market", "a mountain village", "an old kitchen", "a seaside town in winter", "a modern office",
          "a train at rush hour"]
REWRITES = ["Rewrite this so it sounds more polite.", "Rewrite this in a casual tone.", "Make this more formal.",
            "Shorten this to about half its length.", "Turn this into three bullet points.",
            "Proofread this and fix the mistakes.", "Rewrite this for a child of eight.",
            "Give this a title and a one-sentence summary.", "Rewrite this from the reader's point of view.",
            "Rewrite this in plain English with no jargon.", "What is the tone of this text? Explain briefly.",
            "Write a reply to this."]
PROOFREAD = "Proofread this and fix the mistakes."


def request(rng: random.Random) -> tuple[str, str]:
    """(kind, request) from this module's templates."""
    kind = rng.choice(["chat", "chat", "code", "code", "math", "list", "creative"])
    return ("chat" if kind == "creative" else kind), {
        "chat": _chat, "code": _code, "math": _math, "list": _list, "creative": _creative}[kind](rng)


def _chat(rng):
    pick = rng.randrange(7)
    if pick == 0:
        return f"My {rng.choice(RELATIONS)} {rng.choice(PROBLEMS)}. What should I do?"
    if pick == 1:
        time, event = rng.choice(PREPARATIONS)
        return f"I have {time} before {event}. How should I prepare?"
    if pick == 2:
        a, b = rng.choice(CHOICES)
        return f"Is it better to {a} or {b}? Help me decide."
    if pick == 3:
        return f"Explain {rng.choice(EXPLAIN_TOPICS)} as if {rng.choice(AUDIENCES)}."
    if pick == 4:
        return rng.choice([f"What would happen if {rng.choice(HYPOTHETICALS)}?", f"Why do {rng.choice(PHENOMENA)}?"])
    if pick == 5:
        a, b = rng.choice(PAIRS)
        return f"What is the difference between {a} and {b}?"
    return f"You are {rng.choice(ROLES)}. {rng.choice(ROLE_ASKS)}"


def _code(rng):
    lang = rng.choice(LANGUAGES)
    pick = rng.randrange(5)
    if pick == 0:
        return f"Write a {lang} function that {rng.choice(FUNCTION_TASKS)}."
    if pick == 1:
        return f"How do I {rng.choice(HOW_TOS)} in {lang}?"
    if pick == 2:
        return f"What does this error mean and how do I fix it?\n\n{rng.choice(ERRORS)}"
    if pick == 3:
        return f"Write a SQL query that {rng.choice(SQL_TASKS)}."
    return f"Give me a shell command that {rng.choice(SHELL_TASKS)}."


def _math(rng):
    name, pick = rng.choice(NAMES), rng.randrange(8)
    a, b, c = rng.randint(3, 60), rng.randint(2, 15), rng.randint(2, 9)
    return [f"{name} reads {b * 4} pages a day. How many days does a book of {b * 4 * a + c} pages take?",
            f"A tank holds {a * 20} litres and drains at {b} litres per minute. How long until it is empty?",
            f"What is {c * 5}% of {a * 12}?",
            f"A jacket costs {a * 3} dollars and is {c * 5}% off. What do I pay?",
            f"The average of {c} numbers is {a}. A new number, {a + b * 3}, is added. What is the new average?",
            f"Solve: x + y = {a + b}, x - y = {a - b}.",
            f"A car uses {c} litres of fuel per 100 km. How much fuel does it need for {a * 25} km, and what does "
            f"that cost at {b / 10 + 1:.2f} dollars a litre?",
            f"{name} walks at {c} km/h and cycles at {b + 10} km/h. How much time does cycling {a} km save?"][pick]


def _list(rng):
    return rng.choice([f"How do I {rng.choice(HOWTO_TASKS)}? Give me the steps.",
                       f"What are the pros and cons of {rng.choice(PROS_AND_CONS)}?",
                       f"Give me a {rng.randint(3, 7)}-day plan to {rng.choice(GOALS)}."])


def _creative(rng):
    return f"Write a {rng.choice(FORMS)} about {rng.choice(SUBJECTS)}."


def passage_request(rng: random.Random) -> str:
    """Ask the target for a short text of its own, to be rewritten later."""
    return rng.choice([f"Write a short email to {rng.choice(PASSAGE_RECIPIENTS)} about {rng.choice(PASSAGE_SUBJECTS)}.",
                       f"Write a short review of {rng.choice(REVIEWED)}.",
                       f"Write a short announcement about {rng.choice(ANNOUNCED)}.",
                       f"Write a paragraph describing {rng.choice(PLACES)}."])


def rewrite_request(passage: str, rng: random.Random) -> str:
    """An instruction about a passage; a passage to proofread first gets a few mistakes."""
    instruction = rng.choice(REWRITES)
    if instruction == PROOFREAD:
        passage = with_typos(passage, rng)
    return f"{instruction}\n\n{passage}"


def with_typos(text: str, rng: random.Random, rate: float = 0.06) -> str:
    """Swap two letters in about `rate` of the words longer than three letters."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) > 3 and word.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(word) - 2)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2:]
    return " ".join(words)


def acceptable_passage(text: str) -> bool:
    """A passage worth rewriting: a few sentences, no loop, no repeated line."""
    words = text.split()
    if not 80 <= len(text) <= 1200 or len(set(words)) < 0.4 * len(words):
        return False
    lines = [l for l in text.splitlines() if l.strip()]
    return len(set(lines)) == len(lines)
