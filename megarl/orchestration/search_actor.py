"""The one Ray actor that holds the built-in search's BM25 index for a whole run.

index = SearchActor(corpus, top_k)          # builds the index once; ToolError for a bad corpus
index.submit(["query", ...]).result()       # ["Doc 1: ...\\nDoc 2: ...", ...], one per query
index.close()
"""

from concurrent.futures import Future

import ray
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from megarl.tools.builtin.search import BM25Index
from megarl.tools.calls import ToolError


class _IndexHost:
    """The actor body: the index is built by a method (not the constructor), so a bad corpus comes
    back as the ToolError it raised instead of a dead actor."""

    def build(self, corpus: str, top_k: int) -> int:
        self.index = BM25Index(corpus, top_k)
        return len(self.index)

    def search(self, queries: list[str]) -> list[str]:
        return self.index.search(queries)


class SearchActor:
    def __init__(self, corpus: str, top_k: int):
        # On the driver's node, where validation found the corpus; no CPU reserved: the index must not
        # wait for (or take) CPUs the training roles hold.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.actor = ray.remote(num_cpus=0, scheduling_strategy=here)(_IndexHost).remote()
        try:
            self.documents = ray.get(self.actor.build.remote(corpus, top_k))
        except RayTaskError as error:
            ray.kill(self.actor)
            if isinstance(error.cause, ToolError):
                raise ToolError(str(error.cause)) from None
            raise

    def submit(self, queries: list[str]) -> Future:
        return self.actor.search.remote(queries).future()

    def close(self) -> None:
        ray.kill(self.actor)
