#!/usr/bin/env python3
"""Stop the service without cutting the requests in flight.

Ctrl-C on ``serve run`` and ``serve shutdown`` shut Serve down, and Serve kills its HTTP
proxies first (``ray.kill``): every request still in flight through them is cut at once,
streams included. Deleting the application instead stops its replicas the way a scale-in
does, behind proxies that keep running: each ingress replica finishes the requests it
serves (Serve's ``graceful_shutdown_timeout_s``, ``drain_timeout_s + 30`` here) and each
engine replica drains its engine (docs/operations.md, "Stopping"). This command deletes
the application, waits until it is gone, and returns; then stop ``serve run`` (Ctrl-C,
SIGTERM) with nothing left to cut. Under systemd, it is the unit's ``ExecStop``.

Usage (from the repository root, on a host of the Ray cluster)::

    .venv/bin/python -m deploy.stop                     # the application "prefix-router"
    .venv/bin/python -m deploy.stop --app my-app --address ray://head:10001

``--address auto`` (the default) is Ray's own lookup: ``RAY_ADDRESS``, then the cluster
``ray start`` recorded, then any running on the host; with several Ray clusters on one host
it may find another than the service's (it then names the applications it found there and
deletes nothing): give the service's GCS address.

Exit status: 0 once the application is deleted (or was not running), 1 when Ray could not
be reached; any other error is raised (a traceback, exit status 1). Under systemd, give the
unit a ``TimeoutStopSec`` above ``drain_timeout_s + 30`` (90 s by default, systemd's own
default too) so that the drain is not cut.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--app", default="prefix-router",
                    help="the Serve application's name (the config's applications[].name)")
    ap.add_argument("--address", default="auto",
                    help="the Ray cluster to reach (ray.init's address; default: the local one)")
    a = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as deploy/run.sh starts Ray
    import ray
    from ray import serve
    try:
        ray.init(address=a.address, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, RuntimeError) as exc:
        print(f"no Ray cluster at {a.address}: {exc}", file=sys.stderr)
        return 1
    from ray.serve.exceptions import RayServeException
    try:
        try:
            apps = serve.status().applications
        except RayServeException as exc:  # no Serve instance on the cluster
            print(f"no Serve on the Ray cluster at {a.address}: {exc}", file=sys.stderr)
            apps = {}
        running = a.app in apps
        if not running:
            print(f"applications on the Ray cluster at {a.address}: {sorted(apps)}",
                  file=sys.stderr)
        if running:
            serve.delete(a.app)  # returns once its replicas have finished and stopped
        print(f"application {a.app!r} " + ("deleted: its requests in flight finished"
                                          if running else "was not running"))
        return 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
