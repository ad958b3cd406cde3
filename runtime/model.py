"""The public API: load a bundle, generate text (whole or streamed), with stats."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from .bundle import BundleError, load_bundle
from .dflash import DFlashDrafter, DrafterSession
from .eagle3 import Eagle3Drafter, Eagle3Session
from .drafters import Drafter, HybridDrafter, LookupDrafter, ModelDrafter
from .policy import Policy, VerifyCost
from .sampling import Sampler, SamplingParams
from .speculative import speculative_steps
from .suffix import AnswerMemory, SuffixIndex
from .target import Target
from .text import StopMatcher, StreamDecoder, TextCodec



@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0  # from the first new token to the last
    steps: int = 0  # target calls after prefill
    draft_ms: float = 0.0  # speculative decoding: time spent drafting ...
    verify_ms: float = 0.0  # ... and verifying (target calls), summed over steps
    accept_hist: list[int] = field(default_factory=list)  # steps by number of drafts accepted

    def record_step(self, accepted: int, draft_ms: float, verify_ms: float) -> None:
        self.steps += 1
        self.draft_ms += draft_ms
        self.verify_ms += verify_ms
        self.accept_hist.extend([0] * (accepted + 1 - len(self.accept_hist)))
        self.accept_hist[accepted] += 1

    @property
    def mean_accept_len(self) -> float:
        """Tokens committed per target call after prefill (1.0 for plain decoding)."""
        return (self.new_tokens - 1) / self.steps if self.steps else 1.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding (the first comes from prefill)."""
        return (self.new_tokens - 1) / (self.decode_ms / 1e3) if self.decode_ms > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else 0.0

    def summary(self) -> str:
        text = (f"prompt {self.prompt_tokens} tokens, prefill {self.prefill_ms:.0f} ms "
                f"({self.prefill_tokens_per_s:.0f} tok/s); {self.new_tokens} new tokens, "
                f"decode {self.decode_tokens_per_s:.1f} tok/s")
        if self.accept_hist:
            n = self.steps
            text += (f"\n{n} verify steps, {self.mean_accept_len:.2f} tokens per step; per step: draft "
                     f"{self.draft_ms / n:.1f} ms, verify {self.verify_ms / n:.1f} ms"
                     f"\ndrafts accepted per step: " + " ".join(
                         f"{k}:{c}" for k, c in enumerate(self.accept_hist) if c))
        return text


@dataclass
class Result:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", "error"
    stats: Stats = field(default_factory=Stats)


class Model:
    """A target model bundle, ready to generate.

    >>> model = Model("bundles/smollm2")
    >>> print(model.generate(messages=[{"role": "user", "content": "Hi!"}]).text)
    """

    def __init__(self, bundle_dir: str | Path, threads: int | None = None,
                 target_cores: list[int] | None = None, draft_cores: list[int] | None = None,
                 answer_memory: int = 0):
        """`threads`: intra-op threads per session (default: every usable core).
        `target_cores` / `draft_cores`: pin each session to these cores (0-based).
        `answer_memory`: tokens of its latest answers each copying drafter (`suffix`, `lookup`,
        the `-hybrid`s) keeps to draft from, so a repeated request is drafted from its last answer
        (0: none; output never depends on it, only speed). It also offers `suffix` on a bundle
        without a corpus."""
        if not isinstance(answer_memory, int) or answer_memory < 0:
            raise ValueError(f"answer_memory is a number of tokens, 0 or more; got {answer_memory!r}")
        self.answer_memory = answer_memory
        self._memories: list[AnswerMemory] = []
        self.bundle = load_bundle(bundle_dir)
        self.codec = TextCodec(self.bundle)
        self.threads, self.draft_cores = threads, draft_cores
        self.target = Target(self.bundle, threads, target_cores)
        self.eos_ids = set(self.bundle.eos_token_ids)
        self.capacity = self.target.capacity
        self._busy = threading.Lock()
        self._cost: VerifyCost | None = None
        self._draft_models: dict[str, Target] = {}
        self._dflash: DrafterSession | None = None
        self._eagle3: Eagle3Session | None = None
        self._drafters: dict[tuple, Drafter] = {}
        self._suffix_index: SuffixIndex | None = None

    @property
    def drafters(self) -> list[str]:
        """The drafters this bundle supports: "lookup", "suffix" when it has a corpus of the
        target's answers (or the Model an `answer_memory`), the DFlash ones when it has a drafter
        graph, and for each draft model in the bundle ("draft-lm", "self-int4", ...) its chain and
        its tree ("draft-lm-tree").
        None on a bundle exported with `--attention gqa|onnx` (see `lossless_attention`)."""
        if not self.lossless_attention:
            return []
        names = ["lookup"]
        if "suffix_corpus" in self.bundle.manifest or self.answer_memory:
            names.append("suffix")
        if "drafter" in self.bundle.graphs:
            names += ["dflash", "dflash-tree", "dflash-hybrid"]
        if "eagle3" in self.bundle.graphs:
            names += ["eagle3", "eagle3-tree", "eagle3-hybrid"]
        for name in self.bundle.manifest.get("drafters", {}):
            names += [name, f"{name}-tree"]
        return names

    @property
    def lossless_attention(self) -> bool:
        """Whether the target's attention computes a row bit for bit alike however many rows are
        verified with it. TreeAttention does (tested); ORT's GroupQueryAttention and ONNX Attention
        sum a row's softmax in an order that depends on the batch, so a verify could pick another
        token than plain decoding at a near tie."""
        return self.bundle.manifest.get("attention", "custom") == "custom"

    def drafter(self, name: str, draft_len: int | None = None) -> Drafter:
        """The drafter `name`, made on first use and kept (with its acceptance statistics).
        `draft_len` None adapts the draft to the measured costs; a number fixes the chain length."""
        if not self.lossless_attention:
            raise ValueError(f"speculative decoding needs the TreeAttention op, and {self.bundle.folder} was "
                             f"exported with --attention {self.bundle.manifest['attention']}, whose rows round "
                             "differently in a verify than in plain decoding (the output could change); "
                             "re-export it with `dflash-export target SRC --attention custom`")
        if name not in self.drafters:
            raise ValueError(f"this bundle has no drafter {name!r} (it has: {', '.join(self.drafters)}); "
                             + self._how_to_add(name))
        if draft_len is not None and not 0 <= draft_len:
            raise ValueError(f"draft_len must be >= 0 or None (adaptive); got {draft_len}")
        key = (name, draft_len)
        if key not in self._drafters:
            if self._cost is None:  # scratch rows: only ever before a generation's prefill
                self._cost = VerifyCost.measure(self.target)
            policy = Policy(self._cost, draft_len)
            if name in ("lookup", "suffix"):
                corpus = self._corpus() if name == "suffix" else None
                self._drafters[key] = LookupDrafter(policy, corpus=corpus, memory=self._memory())
            elif name.startswith("dflash"):
                if self._dflash is None:
                    threads = len(self.draft_cores) if self.draft_cores else self.threads
                    self._dflash = DrafterSession(self.bundle, threads, self.draft_cores)
                dflash = DFlashDrafter(policy, self._dflash, tree=name != "dflash")
                if name == "dflash-hybrid":
                    dflash = HybridDrafter(policy, dflash, self._copier(policy))
                self._drafters[key] = dflash
            elif name.startswith("eagle3"):
                if self._eagle3 is None:
                    threads = len(self.draft_cores) if self.draft_cores else self.threads
                    self._eagle3 = Eagle3Session(self.bundle, threads, self.draft_cores)
                eagle3 = Eagle3Drafter(policy, self._eagle3, tree=name != "eagle3")
                if name == "eagle3-hybrid":
                    eagle3 = HybridDrafter(policy, eagle3, self._copier(policy))
                self._drafters[key] = eagle3
            else:
                tree = name.endswith("-tree")
                model = self._draft_model(name.removesuffix("-tree"))
                self._drafters[key] = ModelDrafter(policy, model, tree)
        return self._drafters[key]

    def _copier(self, policy: Policy) -> LookupDrafter:
        """A hybrid's copying branch: prompt lookup, the answer memory and the corpus."""
        return LookupDrafter(policy, corpus=self._corpus(), memory=self._memory())

    def _memory(self) -> AnswerMemory | None:
        """A new drafter's own memory of the answers it serves (None without `answer_memory`)."""
        if not self.answer_memory:
            return None
        self._memories.append(AnswerMemory(self.answer_memory))
        return self._memories[-1]

    def forget_answers(self) -> None:
        """Empty every drafter's answer memory (e.g. between benchmark runs of the same prompts)."""
        for memory in self._memories:
            memory.clear()

    def _corpus(self) -> SuffixIndex | None:
        """The suffix drafter's index of the bundle's corpus (built once, ~1 s per million tokens),
        or None if the bundle has no corpus."""
        entry = self.bundle.manifest.get("suffix_corpus")
        if entry is None:
            return None
        if self._suffix_index is None:
            self._suffix_index = SuffixIndex(np.load(self.bundle.folder / entry["file"]))
        return self._suffix_index

    def _how_to_add(self, name: str) -> str:
        """The export command that adds the drafter `name` to this bundle."""
        folder = self.bundle.folder
        if name.startswith("dflash"):
            return (f"add a DFlash drafter with `dflash-export drafter default --target {folder}` (the default "
                    f"model's trained drafter) or `dflash-export drafter DRAFTER_FOLDER --target {folder}`")
        if name.startswith("eagle3"):
            return f"add an EAGLE-3 head with `dflash-export drafter HEAD_FOLDER --target {folder}`"
        if name == "suffix":
            return (f"add its corpus of the target's own answers with `dflash-export corpus ANSWERS_FOLDER "
                    f"--target {folder}` (the default model's: campaign/smollm2/answers), or load the Model "
                    "with answer_memory=TOKENS to draft from its own latest answers")
        if name.startswith("self-"):
            dtype = name.removeprefix("self-").removesuffix("-tree")
            return f"add it with `dflash-export draft-lm --self {dtype} --target {folder}`"
        return (f"add a draft model with `dflash-export draft-lm SRC --target {folder}` or "
                f"`dflash-export draft-lm --self int4 --target {folder}`")

    def _draft_model(self, name: str) -> Target:
        if name not in self._draft_models:
            entry = self.bundle.manifest["drafters"][name]
            draft = load_bundle(self.bundle.folder / entry["dir"])
            if self.codec.tokenizer.get_vocab() != TextCodec(draft).tokenizer.get_vocab():
                raise BundleError(f"the drafter in {draft.folder} has another tokenizer than the target "
                                  f"{self.bundle.folder}: a draft model must share the target's "
                                  "vocabulary; export a drafter from the same model family")
            threads = len(self.draft_cores) if self.draft_cores else self.threads
            self._draft_models[name] = Target(draft, threads, self.draft_cores, exact=False)
        return self._draft_models[name]

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
               input_ids: list[int] | None = None) -> list[int]:
        """Token ids of a plain prompt, chat messages (the model's template), or ids as given."""
        if sum(x is not None for x in (prompt, messages, input_ids)) != 1:
            raise ValueError("give exactly one of prompt=, messages= or input_ids=")
        if input_ids is not None:
            ids = [int(i) for i in input_ids]
            bad = [i for i in ids if not 0 <= i < self.bundle.vocab_size]
            if bad:
                raise ValueError(f"input_ids holds {bad[0]}, outside the vocabulary 0..{self.bundle.vocab_size - 1}")
        elif messages is not None:
            ids = self.codec.encode_chat(messages)
        else:
            ids = self.codec.encode_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty: it encodes to no tokens")
        return ids

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               input_ids: list[int] | None = None, max_new_tokens: int = 128,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int | None = None, stop=None, ignore_eos: bool = False,
               drafter: str | None = None, draft_len: int | None = None,
               truncate: str | None = None) -> "Generation":
        """An iterator of text pieces; its `.result` holds tokens, finish reason and stats.

        temperature 0 is greedy decoding; `stop` is a string or a list of strings that end
        the text (not included); `ignore_eos` decodes past EOS up to max_new_tokens.
        `drafter` ("dflash", "dflash-tree", "lookup", "self-int4", ...; see `.drafters`) decodes
        speculatively, with output identical to decoding without it (greedy), or
        distributed identically (sampling); `draft_len` fixes its chain length.
        A prompt that fills the cache is an error, or with `truncate="left"` loses its oldest
        tokens; generation stops with finish reason "length" when the cache is full."""
        ids = self.encode(prompt, messages, input_ids)
        params = SamplingParams(temperature, top_k, top_p, seed)
        ids, max_new_tokens = self._fit(ids, max_new_tokens, truncate)
        chosen = self.drafter(drafter, draft_len) if drafter else None
        eos = set() if ignore_eos else self.eos_ids
        return Generation(self, ids, params, max_new_tokens, stop, eos, chosen)

    def generate(self, prompt: str | None = None, **kwargs) -> Result:
        generation = self.stream(prompt, **kwargs)
        for _ in generation:
            pass
        return generation.result

    def _fit(self, ids: list[int], max_new_tokens: int, truncate: str | None) -> tuple[list[int], int]:
        """The prompt and token budget that fit the cache: generating n tokens feeds n-1 of
        them back, so at most capacity - prompt + 1 new tokens (then finish reason "length")."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
        if truncate not in (None, "left"):
            raise ValueError(f"truncate must be None or 'left'; got {truncate!r}")
        if len(ids) >= self.capacity:
            if truncate is None:
                raise ValueError(f"the prompt has {len(ids)} tokens but this bundle holds {self.capacity} "
                                 "in all: shorten the prompt, pass truncate='left' to drop its oldest "
                                 "tokens, or re-export with a larger --max-len")
            # Keep at least half the cache for the prompt, and room for the answer up to that.
            ids = ids[-(self.capacity - min(max_new_tokens, self.capacity // 2)):]
        return ids, min(max_new_tokens, self.capacity - len(ids) + 1)

    def _decode_tokens(self, token: int, past: int, sampler: Sampler, stats: Stats) -> Iterator[list[int]]:
        """Plain autoregressive decoding after `token`: yields one new token at a time."""
        one = np.ones((1, 1), np.bool_)
        while True:
            logits = self.target.forward([token], [past], one, past)
            past += 1
            stats.steps += 1
            token = sampler(logits[0])
            yield [token]


class Generation:
    """One generation in progress: iterate for text pieces, then read `.result`."""

    def __init__(self, model: Model, ids: list[int], params: SamplingParams, max_new_tokens: int,
                 stop, eos_ids: set[int], drafter: Drafter | None = None):
        self.model, self.ids, self.params, self.eos_ids = model, ids, params, eos_ids
        self.max_new_tokens = max_new_tokens
        self.drafter = drafter
        self.stops = StopMatcher(stop)
        self.result = Result(stats=Stats(prompt_tokens=len(ids)))

    def __iter__(self) -> Iterator[str]:
        model = self.model
        if not model._busy.acquire(blocking=False):
            raise RuntimeError("this Model is already generating (in another thread or an unfinished "
                               "stream); finish that one first, or load one Model per thread")
        try:
            yield from self._run()
        except GeneratorExit:  # the consumer stopped early: not an error
            self.result.finish_reason = self.result.finish_reason or "stop"
            raise
        except BaseException:
            self.result.finish_reason = "error"
            raise
        finally:
            model._busy.release()

    def _token_chunks(self, stats: Stats) -> Iterator[list[int]]:
        """Prefill, the first token, then the chosen decoding loop's chunks of new tokens."""
        target, sampler, drafter = self.model.target, Sampler(self.params), self.drafter
        on_chunk = None
        if drafter:
            drafter.begin()
            if drafter.wants_taps:  # the prompt's taps are the drafter's first context
                def on_chunk(start, s):
                    drafter.add_context(target.taps(s))
        start = time.perf_counter()
        first = sampler(target.prefill(self.ids, on_chunk=on_chunk))
        stats.prefill_ms = (time.perf_counter() - start) * 1e3
        yield [first]
        if self.drafter:
            yield from speculative_steps(target, self.drafter, self.ids + [first], sampler, stats)
        else:
            yield from self.model._decode_tokens(first, len(self.ids), sampler, stats)

    def _run(self) -> Iterator[str]:
        result, stats = self.result, self.result.stats
        decoder = StreamDecoder(self.model.codec)
        chunks = self._token_chunks(stats)
        first_token_at = None
        for chunk in chunks:
            first_token_at = first_token_at or time.perf_counter()
            for token in chunk:
                result.tokens.append(token)
                if token in self.eos_ids:
                    result.finish_reason = "stop"
                    break
                piece, stopped = self.stops.feed(decoder.push([token]))
                if piece:
                    yield piece
                if stopped:
                    result.finish_reason = "stop"
                    break
                if len(result.tokens) >= self.max_new_tokens:
                    result.finish_reason = "length"
                    break
            if result.finish_reason:
                break
        chunks.close()
        stats.decode_ms = (time.perf_counter() - first_token_at) * 1e3
        stats.new_tokens = len(result.tokens)
        if self.drafter:  # after the clock: an answer memory rebuilds its index here
            self.drafter.remember(result.tokens)
        tail = self.stops.flush()
        if tail:
            yield tail
        result.text = self.stops.text
