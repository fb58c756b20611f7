"""A ready locustfile for prefix-router (or any OpenAI-compatible server).

    # the router, multi-turn chat users, headless, 2 minutes, CSV and HTML reports
    locust -f loadtest/locustfile.py MultiTurnChatUser --host http://127.0.0.1:8000 \\
        -u 32 -r 4 -t 2m --headless --csv out/run --html out/run.html

    # the same against one vLLM engine directly: only --host changes (its URL:
    # metadata.engine_url in the router's GET /replicas)
    locust -f loadtest/locustfile.py MultiTurnChatUser --host http://127.0.0.1:<port> ...

    # the Mooncake conversation trace at 4x its pace
    locust -f loadtest/locustfile.py TraceReplayUser --host ... -u 64 --trace-speed 4

    # distributed: one master, N workers (locust's own distribution)
    locust -f loadtest/locustfile.py --master --expect-workers 4 ...
    locust -f loadtest/locustfile.py --worker --master-host 127.0.0.1   # x 4

The users and their options are in ``loadtest/openai_users.py``; ``python -m
loadtest.openai_users`` lists the options (locust's ``--help`` does not: it prints before
it reads this file).
"""

import sys
from pathlib import Path

# locust puts this file's folder on sys.path; the kit is imported as ``loadtest.*`` from the
# checkout's root, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.openai_users import (  # noqa: E402,F401
    MultiTurnChatUser,
    PacedChatUser,
    TraceReplayUser,
)
