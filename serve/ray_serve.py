"""Scale-out: the same app as a Ray Serve deployment, one replica per `Model`.

Ray Serve does the cluster, the routing and the load balancing; each replica builds its own
`Model` (the ORT sessions cannot be pickled) and serves the FastAPI app of `create_app` with one
worker, so the 429 queue, streaming and errors behave as under `dflash-serve`.

    ray start --head                                   # or an existing cluster
    serve run dflash.serve.ray_serve:build bundle=$PWD/bundles/smollm2 replicas=2 threads=1

The bundle path must exist on every node that runs a replica (a shared or copied folder).
"""

from __future__ import annotations

from pathlib import Path


def deployment(bundle: str | Path, drafter: str | None = None, replicas: int = 1, threads: int = 1,
               max_waiting: int = 8):
    """A bound Ray Serve application: `replicas` copies of the server, each one `Model` on
    `threads` cores (reserved from Ray as CPUs)."""
    from ray import serve

    from .app import create_app

    bundle = str(Path(bundle).resolve())  # replicas do not run in the caller's directory

    @serve.ingress()
    class DFlashReplica:
        def __init__(self):
            self.server = create_app(bundle, drafter, workers=1, max_waiting=max_waiting, threads=threads)

        def __serve_build_asgi_app__(self):
            return self.server

    # Ray queues past this many requests per replica itself; our own queue answers 429 first
    return serve.deployment(DFlashReplica, name="dflash", num_replicas=replicas,
                            ray_actor_options={"num_cpus": threads},
                            max_ongoing_requests=max_waiting + 1).bind()


def build(args: dict):
    """The application builder for `serve run dflash.serve.ray_serve:build key=value ...` (keys:
    bundle, drafter, replicas, threads, queue)."""
    known = {"bundle", "drafter", "replicas", "threads", "queue"}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    if "bundle" not in args:
        raise ValueError("name the bundle: serve run dflash.serve.ray_serve:build bundle=/path/to/bundle")
    return deployment(args["bundle"], args.get("drafter"), int(args.get("replicas", 1)),
                      int(args.get("threads", 1)), int(args.get("queue", 8)))
