"""The reward worker process: `python -m megarl.rewards.worker <fd> <spec>` (started by `RewardScorer`).

It imports the reward function once, says so, then serves calls over the connection on file
descriptor `fd` until the connection closes or a `None` request arrives. Every reply is a pair:

    ("ready", None | message)   after start-up: the message says why the function does not resolve
    ("ok", [float, ...])        one checked score per response
    ("error", traceback text)   the function raised: its samples score 0, the run goes on
    ("invalid", message)        the function does not resolve, returned a bad result or raised
                                RewardFunctionError: the run stops

Requests are `(first, prompts, responses, columns)`, `first` being the batch index of the chunk's
first response (to name a bad score by its place); see `megarl.rewards.functions` for the signature.
"""

from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection

from megarl.isolation import serve, worker_connection
from megarl.rewards.functions import RewardFunctionError, checked_scores, resolve_reward_function


def serve_reward(connection: Connection, spec: str) -> None:
    try:
        function, failure = resolve_reward_function(spec), None
    except RewardFunctionError as error:
        function, failure = None, str(error)

    def score(request) -> tuple[str, object]:
        first, prompts, responses, columns = request
        if failure is not None:
            return "invalid", failure
        try:
            result = function(prompts, responses, **columns)
        except RewardFunctionError as error:  # the function says it cannot score (malformed test cases)
            return "invalid", str(error)
        except (Exception, SystemExit):  # a user bug costs this call's samples, not the worker
            return "error", traceback.format_exc()
        try:
            return "ok", checked_scores(spec, result, responses, first)
        except RewardFunctionError as error:
            return "invalid", str(error)

    serve(connection, failure, score)


if __name__ == "__main__":
    serve_reward(worker_connection(sys.argv[1]), sys.argv[2])
