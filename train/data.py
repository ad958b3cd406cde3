"""The campaign's data job: rounds of the target's own sampled answers, resumable.

Each round writes one shard (`shard-NNNNN.npz`, see shards.py): the target first writes
candidate requests of its own (Magpie), then answers a batch that mixes those with
template, grounded, word-definition and follow-up requests, sampled at temperature 0.7
(or another `temperature`; 0: the target's greedy answers, the text the runtime drafts after)
with its argmax recorded at every position.  A round's random choices depend only on
(seed, round, recipe), so a resumed job continues exactly where an interrupted one stopped.

Recipe 1 is the mix above with prompts.py's templates; recipe 2 (varied.py) spreads the
templates over many more kinds of request, adds passages the target writes and is then
asked to rewrite, and follows conversations up to three user turns deep.  With a prompt file
(`requests`: a user's own traffic, the way published drafters learn from real conversations)
each round answers the file's next BATCH requests instead, and the job ends with the file.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from . import prompts, shards, varied
from .sampler import looping, sample

# Rows per round by source (the batch); magpie gets what its candidates yield, templates fill the rest.
MIX = {"magpie": 28, "followup": 8, "grounded": 12, "define": 4}
MIX_VARIED = {"magpie": 16, "followup": 8, "passage": 10, "grounded": 8, "define": 2}  # recipe 2
BATCH = 64
DEFAULT_TEMPERATURE = 0.7  # the answers'; the requests the target writes itself are sampled at 0.8
MAGPIE_CANDIDATES = 40
PASSAGE_CANDIDATES = 14
FOLLOWUP_DEPTH = 3  # recipe 2: user turns in a conversation at most (recipe 1: 2)


class Target:
    """The target in transformers (fp32, or emulating an int4 bundle), with its chat template and end
    tokens; `engine`: an OrtSampler to sample with the exported graph instead (ort_sampler.py)."""

    def __init__(self, source, engine=None):
        self.model, self.tokenizer, self.engine = source.model, source.tokenizer, engine
        tok = self.tokenizer
        self.end_ids = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"),
                                    tok.convert_tokens_to_ids("<|eot_id|>")) if isinstance(i, int) and i >= 0}
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else min(self.end_ids)
        marker = "\x00REQUEST\x00"
        rendered = self.render([{"role": "user", "content": marker}])
        self.user_opening = rendered[: rendered.index(marker)]  # system turn + opening of a user turn

    def sample(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, seed: int):
        """Sampled answers with the target's argmax at every position (sampler.Sampled)."""
        if self.engine:
            return self.engine.sample(prompts, max_new_tokens, self.end_ids, temperature=temperature, top_p=top_p,
                                      seed=seed)
        return sample(self.model, prompts, max_new_tokens, self.end_ids, self.pad_id, temperature=temperature,
                      top_p=top_p, seed=seed)

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def magpie_requests(target: Target, rng: random.Random, seen: set, seed: int) -> list[str]:
    """Requests the target writes itself, filtered and deduplicated against `seen`."""
    openings = [rng.choice(prompts.OPENINGS) for _ in range(MAGPIE_CANDIDATES)]
    starts = [target.encode(target.user_opening + o) for o in openings]
    out = []
    for opening, s in zip(openings, target.sample(starts, 96, temperature=0.8, top_p=0.95, seed=seed)):
        if not s.ended:
            continue
        text = (opening + target.decode(s.tokens)).strip()
        key = prompts.dedup_key(text)
        if prompts.acceptable_request(text) and key not in seen:
            seen.add(key)
            out.append(text)
    return out


def passages(target: Target, rng: random.Random, seed: int) -> list[str]:
    """Short texts the target writes on request (emails, reviews, notices), to be rewritten."""
    asks = [varied.passage_request(rng) for _ in range(PASSAGE_CANDIDATES)]
    starts = [target.encode(target.render([{"role": "user", "content": a}])) for a in asks]
    texts = [target.decode(s.tokens).strip() for s in target.sample(starts, 192, temperature=0.8, top_p=0.95, seed=seed)
             if s.ended]
    return [t for t in texts if varied.acceptable_passage(t)]


def answer_temperature(row: dict) -> float:
    """The temperature a stored row's answer was sampled at (rows from before the option hold none)."""
    return row.get("temperature", DEFAULT_TEMPERATURE)


def round_id(prefix: str, rnd: int) -> str:
    """What every row id of a round starts with."""
    return f"{prefix}{rnd:05d}-"


def user_turns(row: dict) -> int:
    """User turns in a row's conversation (recipe 1 does not record it: there a follow-up had two,
    any other row one)."""
    return row.get("turns", 2 if row["source"] == "followup" else 1)


def plan_round(target: Target, rnd: int, seed: int, seen: set, previous: list[dict], prefix: str = "r",
               recipe: int = 1) -> list[dict]:
    """The requests of one round, each with its provenance."""
    rng = random.Random(f"{seed}-{rnd}" if recipe == 1 else f"{seed}-{rnd}-recipe{recipe}")
    mix, depth = (MIX, 2) if recipe == 1 else (MIX_VARIED, FOLLOWUP_DEPTH)
    rows = [{"kind": "chat", "source": "magpie", "messages": [{"role": "user", "content": t}]}
            for t in magpie_requests(target, rng, seen, seed * 100003 + rnd)[: mix["magpie"]]]
    parents = [r for r in previous if len(r["answer"]) >= 16 and not looping(r["answer"])
               and user_turns(r) < depth]
    for parent in rng.sample(parents, min(mix["followup"], len(parents))):
        row = {"kind": parent["kind"], "source": "followup", "parent": parent["id"],
               "followup": rng.choice(prompts.FOLLOWUPS)}
        if recipe != 1:
            row["turns"] = user_turns(parent) + 1
        rows.append(row)
    if mix.get("passage"):
        for text in passages(target, rng, seed * 100003 + rnd + 25000)[: mix["passage"]]:
            rows.append({"kind": "rewrite", "source": "passage",
                         "messages": [{"role": "user", "content": varied.rewrite_request(text, rng)}]})
    for _ in range(mix["grounded"]):
        ref = prompts.grounded_ref(rng)
        if ref:
            rows.append({"kind": "grounded", "source": ref["source"], "ref": ref})
    for _ in range(mix["define"]):
        text = prompts.define_request(rng)
        if text:
            rows.append({"kind": "chat", "source": "wordnet", "messages": [{"role": "user", "content": text}]})
    while len(rows) < BATCH:
        kind, text = (prompts.template_request if recipe == 1 else varied.request)(rng)
        rows.append({"kind": kind, "source": "template", "messages": [{"role": "user", "content": text}]})
    for i, row in enumerate(rows):
        row["id"] = f"{round_id(prefix, rnd)}{i:02d}"
    return rows


ROLES = ("system", "user", "assistant")  # of a prompt file's messages


def read_requests(path: Path) -> list[dict]:
    """A prompt file: JSON lines, each {"messages": [{"role", "content"}, ...]} ending in a user turn
    (earlier turns are kept as written) or {"prompt": "..."}; an optional "kind" labels it."""
    requests = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not JSON ({e.msg}): write one JSON object per line") from None
        messages = item.get("messages") if isinstance(item, dict) else None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str) and messages is None:
            messages = [{"role": "user", "content": item["prompt"]}]
        if (not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ROLES for m in messages)
                or messages[-1]["role"] != "user"):
            raise ValueError(f"{where}: give {{\"prompt\": \"...\"}} or {{\"messages\": [...]}} with roles "
                             f"{', '.join(ROLES)} and a user turn last")
        requests.append({"kind": str(item.get("kind", "chat")), "messages": messages})
    if not requests:
        raise ValueError(f"{path} holds no requests: write one JSON object per line")
    return requests


def file_round(requests: list[dict], rnd: int, prefix: str) -> list[dict]:
    """Round `rnd` of a prompt file: its requests rnd*BATCH on (none once the file is used up)."""
    rows = [{"kind": r["kind"], "source": "file", "messages": r["messages"]}
            for r in requests[rnd * BATCH:(rnd + 1) * BATCH]]
    for i, row in enumerate(rows):
        row["id"] = f"{round_id(prefix, rnd)}{i:02d}"
    return rows


def run(target: Target, out: Path, answer_tokens: int, seed: int = 0, max_new_tokens: int = 320,
        echo=print, prefix: str = "r", recipe: int = 1, temperature: float = DEFAULT_TEMPERATURE,
        requests: list[dict] | None = None) -> None:
    """Add rounds to `out` until its answers hold `answer_tokens` tokens. `prefix` starts every row
    id, so folders answered by different targets (fp32, int4) or recipes can be fitted together.
    `temperature` of the answers (top-p 0.95); 0 answers greedily.  `requests` (read_requests):
    answer these, BATCH a round, instead of the recipe's, until they are used up."""
    out.mkdir(parents=True, exist_ok=True)
    done = shards.read_all(out)
    if done and not done[0]["id"].startswith(round_id(prefix, 0)):  # shards are read in round order
        raise ValueError(f"{out} holds rows with ids like {done[0]['id']}, not {prefix}...: resume it with the "
                         "--id-prefix (and --target, --seed) it was started with")
    started_at = answer_temperature(done[-1]) if done else temperature
    if started_at != temperature:
        raise ValueError(f"{out} holds answers sampled at temperature {started_at}, not {temperature}: resume it "
                         f"with --temperature {started_at}")
    by_id = {r["id"]: r for r in done}
    seen = {prompts.dedup_key(r["messages"][0]["content"]) for r in done if r["source"] == "magpie"}
    total = sum(len(r["answer"]) for r in done)
    rnd = len(list(out.glob("shard-*.npz")))
    previous = [r for r in done if r["id"].startswith(round_id(prefix, rnd - 1))]
    start, made = time.perf_counter(), 0
    started_with = min(rnd * BATCH, len(requests)) if requests is not None else 0  # requests answered before
    while total < answer_tokens:
        if requests is None:
            rows = plan_round(target, rnd, seed, seen, previous, prefix, recipe)
        else:
            rows = file_round(requests, rnd, prefix)
            if not rows:
                echo(f"the prompt file is used up: {len(requests)} requests answered, {total} answer tokens")
                return
        prompts_ids = [target.encode(target.render(shards.messages(r, by_id, target.decode))) for r in rows]
        for row, s in zip(rows, target.sample(prompts_ids, max_new_tokens, temperature=temperature, top_p=0.95,
                                              seed=seed * 100003 + rnd + 50000)):
            row.update(answer=s.tokens, greedy=s.greedy, ended=s.ended, temperature=temperature)
        shards.write(out / f"shard-{rnd:05d}.npz", rows)
        by_id.update({r["id"]: r for r in rows})
        previous, rnd = rows, rnd + 1
        added = sum(len(r["answer"]) for r in rows)
        total, made = total + added, made + added
        rate = made / (time.perf_counter() - start)
        left = (answer_tokens - total) / max(rate, 1e-9)
        if requests is not None:  # the file ends the job first if its answers fall short of the tokens
            answered = min(rnd * BATCH, len(requests))
            per_request = (time.perf_counter() - start) / max(1, answered - started_with)
            left = min(left, (len(requests) - answered) * per_request)
        echo(f"round {rnd}: {len(rows)} answers ({sum(r['source'] == 'magpie' for r in rows)} self-written requests), "
             f"{total} answer tokens of {answer_tokens}, {rate:.0f} tok/s, ETA {left / 60:.0f} min")
