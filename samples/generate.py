"""`dflash-generate`: generate text with a bundle, streaming it as it comes.

    dflash-generate --prompt "Why is the sky blue?" --stats
    dflash-generate                      # interactive chat
"""

from __future__ import annotations

import os
import sys

import click

DEFAULT_BUNDLE = os.environ.get("DFLASH_BUNDLE", "bundles/smollm2")


def _stream(model, messages, prompt, options) -> object:
    generation = model.stream(prompt, messages=messages, **options)
    for piece in generation:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    sys.stdout.flush()
    return generation.result


def _report(result, stats: bool) -> None:
    s = result.stats
    click.echo(f"[{s.new_tokens} tokens, {s.decode_tokens_per_s:.1f} tok/s, finish: {result.finish_reason}]",
               err=True)
    if stats:
        click.echo(f"[{s.summary()}]", err=True)


@click.command()
@click.option("--bundle", default=DEFAULT_BUNDLE, show_default=True, help="bundle folder")
@click.option("--prompt", help="one prompt; without it, an interactive chat")
@click.option("--raw", is_flag=True, help="send the prompt as plain text, not as a chat message")
@click.option("--system", help="system message for chat")
@click.option("--max-new-tokens", default=256, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-k", default=0, show_default=True, help="0 = off")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", type=int, help="sampling seed")
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--drafter", help="speculative decoding: lookup, self-int4, self-int4-tree, draft-lm, ... "
              "(what the bundle has); output is the same as without")
@click.option("--draft-len", type=int, help="fixed draft chain length (default: adaptive)")
@click.option("--threads", type=int, help="intra-op threads per session (default: all usable cores)")
@click.option("--target-cores", help="pin the target session to these cores, e.g. 0")
@click.option("--draft-cores", help="pin the draft model's session to these cores, e.g. 1")
@click.option("--stats", is_flag=True, help="print prefill, decode and speculation statistics")
@click.option("--compare", is_flag=True, help="with --prompt and --drafter: also run without the drafter "
              "and print both speeds (the output is the same)")
def main(bundle, prompt, raw, system, max_new_tokens, temperature, top_k, top_p, seed, stop, drafter,
         draft_len, threads, target_cores, draft_cores, stats, compare):
    """Generate with a dflash bundle on ONNX Runtime."""
    from dflash.runtime import BundleError, Model
    from dflash.runtime.session import parse_cores

    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                   top_p=top_p, seed=seed, stop=list(stop), drafter=drafter, draft_len=draft_len)
    try:
        model = Model(bundle, threads=threads, target_cores=parse_cores(target_cores),
                      draft_cores=parse_cores(draft_cores))
        history = [{"role": "system", "content": system}] if system else []
        if prompt is not None:
            messages = None if raw else history + [{"role": "user", "content": prompt}]
            result = _stream(model, messages, prompt if raw else None, options)
            _report(result, stats)
            if compare and drafter:
                plain = model.generate(prompt if raw else None, messages=messages, **{**options, "drafter": None})
                same = "same tokens" if plain.tokens == result.tokens else "DIFFERENT tokens"
                click.echo(f"[ar {plain.stats.decode_tokens_per_s:.1f} tok/s vs {drafter} "
                           f"{result.stats.decode_tokens_per_s:.1f} tok/s: "
                           f"{result.stats.decode_tokens_per_s / plain.stats.decode_tokens_per_s:.2f}x, {same}]",
                           err=True)
            return
        click.echo("Chat with the model; an empty line or Ctrl-D ends it.", err=True)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            result = _stream(model, history, None, options)
            history.append({"role": "assistant", "content": result.text})
            _report(result, stats)
    except (BundleError, ValueError, RuntimeError) as e:
        raise click.ClickException(str(e))


if __name__ == "__main__":
    main()
