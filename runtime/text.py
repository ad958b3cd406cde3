"""Text in and out: tokenizing, chat templates, streaming detokenization, stop strings."""

from __future__ import annotations

from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from .bundle import Bundle


def _raise(message):
    raise jinja2.TemplateError(message)


class TextCodec:
    """The bundle's tokenizer and chat template, rendered as transformers renders them."""

    def __init__(self, bundle: Bundle):
        self.tokenizer = Tokenizer.from_file(str(bundle.file(bundle.tokenizer)))
        self.bos_token = bundle.manifest.get("bos_token")
        self.eos_token = bundle.manifest.get("eos_token")
        self.template = None
        path = bundle.file(bundle.manifest.get("chat_template"))
        if path is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals.update(raise_exception=_raise,
                               strftime_now=lambda fmt: datetime.now().strftime(fmt))
            self.template = env.from_string(path.read_text())

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict]) -> str:
        if self.template is None:
            raise ValueError("this bundle's tokenizer has no chat template; pass a plain prompt")
        return self.template.render(messages=messages, add_generation_prompt=True,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template already holds any special tokens, as in transformers.
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class StreamDecoder:
    """Turns a growing token list into text pieces, never splitting a UTF-8 character.

    Decoding a window that starts a few tokens back keeps tokenizer-specific spacing
    right; a piece ending in U+FFFD is an incomplete byte sequence and waits for more.
    """

    def __init__(self, codec: TextCodec):
        self.codec, self.ids = codec, []
        self.prefix, self.read = 0, 0

    def push(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        before = self.codec.decode(self.ids[self.prefix : self.read])
        after = self.codec.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""


class StopMatcher:
    """Finds stop strings in streamed text and holds back what might begin one."""

    def __init__(self, stops):
        self.stops = [s for s in ([stops] if isinstance(stops, str) else stops or []) if s]
        self.text, self.emitted = "", 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add a piece; return (text safe to emit now, stopped)."""
        self.text += piece
        hits = [i for i in (self.text.find(s, max(0, self.emitted - len(s))) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out, self.emitted = self.text[self.emitted : end], max(self.emitted, end)
            self.text = self.text[:end]
            return out, True
        safe = len(self.text) - self._held_back()
        out, self.emitted = self.text[self.emitted : safe], max(self.emitted, safe)
        return out, False

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best
