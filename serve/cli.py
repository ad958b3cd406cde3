"""`dflash-serve`: an OpenAI-compatible server on a bundle.

    dflash-serve --bundle bundles/smollm2 --drafter suffix --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import sys

import click


@click.command()
@click.option("--bundle", default="bundles/smollm2", show_default=True, type=click.Path(exists=True, file_okay=False))
@click.option("--drafter", help="the default drafter (a request may name another in its `drafter` field)")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True)
@click.option("--workers", default=1, show_default=True, help="Models generating at once; they split the cores")
@click.option("--threads", type=int, help="cores per worker (default: the cores split among the workers)")
@click.option("--queue", "max_waiting", default=8, show_default=True,
              help="requests that may wait for a worker; more get 429 with Retry-After")
@click.option("--answer-memory", default=0, show_default=True, type=click.IntRange(min=0),
              help="tokens of its latest answers each worker's copying drafters draft from, so repeated "
              "requests decode faster (answers never change; timing may show a request was seen before)")
def main(bundle, drafter, host, port, workers, threads, max_waiting, answer_memory):
    """Serve /v1/models, /v1/chat/completions and /v1/completions (streaming or not)."""
    import uvicorn

    from .app import create_app

    try:
        app = create_app(bundle, drafter, workers, max_waiting, threads, answer_memory)
    except ValueError as e:
        raise click.ClickException(str(e))
    uvicorn.run(app, host=host, port=port, log_level="info")


if __name__ == "__main__":
    sys.exit(main())
