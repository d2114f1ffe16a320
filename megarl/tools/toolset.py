"""The tools of a run (`rollout.multi_turn.tools`): their schemas, and running a turn's calls concurrently.

    with ToolSet(config.rollout.multi_turn) as toolset:   # starts the isolated tool workers
        toolset.wait_ready()       # before Ray: a tool that does not resolve raises ToolError here
        init_ray(...)
        toolset.start_shared(SearchActor)   # after Ray: the built-in search's index (one Ray actor for the run)
        toolset.schemas()          # [{"type": "function", "function": {...}}, ...] for apply_chat_template(tools=)
        futures = toolset.submit([ToolCall("calculator", {"expression": "2+2"}), ...])   # [Future[ToolResult], ...]
        results = toolset.run(calls)   # the same, waited for: [ToolResult, ...]

User tools (and the built-in `calculator` and `python`) run in a pool of isolated worker processes
(`megarl.tools.pool`): own process group, killed at the tool's `timeout_s`, no credentials; the
driver never imports their code, not even for their schemas. The built-in `search` is megarl's own
code and runs beside them: the search calls of one `submit` go to the index (or the retrieval server)
as one batch. Every call of a `submit` runs at once (as far as `max_workers` allows), each ending on
its own; a failing call becomes a `ToolResult` with an `error` and the run goes on. `submit` is
called from one thread at a time (the agent loop's).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from megarl.config.rollout import MultiTurnConfig
from megarl.tools.builtin import BUILTIN_TOOLS, sandbox_fusion, tool_path
from megarl.tools.builtin.python import backend, sandbox_problem
from megarl.tools.builtin.search import RetrieverClient
from megarl.tools.calls import ToolCall, ToolError, ToolResult, one_line
from megarl.tools.pool import MAX_WORKERS, ToolPool

logger = logging.getLogger(__name__)

SEARCH = "search"
PYTHON = "python"
PYTHON_UNSANDBOXED = "megarl.tools.builtin.python_unsandboxed:python"
"""The python tool where the user allowed it to run without its sandbox (`PythonToolConfig.unsafe_no_sandbox`)."""
PYTHON_REMOTE = "megarl.tools.builtin.sandbox_fusion:python"
"""The python tool on a SandboxFusion server (`PythonToolConfig.sandbox_fusion_url`)."""


class SearchBackend(Protocol):
    """What runs the built-in search's queries: `SearchActor` (`megarl.orchestration.search_actor`) or
    `RetrieverClient` (`megarl.tools.builtin.search`)."""

    def submit(self, queries: list[str]) -> Future: ...

    def close(self) -> None: ...


class ToolSet:
    def __init__(
        self, multi_turn: MultiTurnConfig, *, max_workers: int = MAX_WORKERS, startup_timeout_s: float = 120.0
    ):
        """max_workers: the most tool calls that run at once (more wait for a free worker); each worker
        is a Python process holding every tool. startup_timeout_s: limit for a worker to import the tools."""
        self.tools = multi_turn.tools
        self.search_config = multi_turn.search
        paths = [tool_path(tool.function) for tool in self.tools]
        malformed = [
            f"rollout.multi_turn.tools[{index}].function = {tool.function!r}: neither a built-in tool "
            f"({', '.join(BUILTIN_TOOLS)}) nor `pkg.module:function`; write e.g. my_tools.web:fetch_page"
            for index, (tool, path) in enumerate(zip(self.tools, paths))
            if not _is_function_path(path)
        ]
        if malformed:
            raise ToolError("\n".join(malformed))
        paths = [
            _python_tool_path(multi_turn, index) if path == BUILTIN_TOOLS[PYTHON] else path
            for index, path in enumerate(paths)
        ]
        url = multi_turn.python_tool.sandbox_fusion_url
        env = {sandbox_fusion.URL_ENV: url} if PYTHON_REMOTE in paths else None
        self._pool = (
            ToolPool(paths, max_workers=max_workers, startup_timeout_s=startup_timeout_s, env=env) if paths else None
        )
        self._schemas: list[dict] | None = None
        self._index_by_name: dict[str, int] = {}
        self._search: SearchBackend | None = None
        """The started search backend: `SearchActor` or `RetrieverClient` (both `submit(queries) -> Future`)."""

    def wait_ready(self) -> None:
        """Block until the tools are imported in a worker and their schemas read. Raises ToolError naming
        every tool that does not resolve or has no schema (`rollout.multi_turn.tools[i].function`),
        and tools that share a name."""
        if self._schemas is not None:
            return
        reports = self._pool.first_ready() if self._pool is not None else []
        problems = [
            f"rollout.multi_turn.tools[{index}].function = {tool.function!r}: {report['error']}"
            for index, (tool, report) in enumerate(zip(self.tools, reports))
            if report["error"] is not None
        ]
        if problems:
            raise ToolError("\n".join(problems))
        index_by_name: dict[str, int] = {}
        for index, report in enumerate(reports):
            name = report["schema"]["function"]["name"]
            if name in index_by_name:
                first = index_by_name[name]
                raise ToolError(
                    f"rollout.multi_turn.tools[{index}].function = {self.tools[index].function!r}: its "
                    f"name {name!r} is also the name of tools[{first}] ({self.tools[first].function!r}); "
                    "the model calls tools by name: remove one or rename its function"
                )
            index_by_name[name] = index
        self._index_by_name = index_by_name
        self._schemas = [report["schema"] for report in reports]

    def start_shared(self, index_host: Callable[[str, int], SearchBackend]) -> None:
        """After Ray is up: start what the whole run shares, the built-in search's backend: `index_host(corpus,
        top_k)` (`megarl.orchestration.search_actor.SearchActor`, a Ray actor that builds the BM25 index of
        `rollout.multi_turn.search.corpus` once; handed in by the caller because Ray lives in a layer above
        the tools), or the client of `retriever_url`. A corpus that cannot be read raises ToolError naming
        its file and line."""
        search = next((tool for tool in self.tools if tool.function == SEARCH), None)
        if search is None or self._search is not None:
            return
        settings = self.search_config
        if settings.retriever_url:
            self._search = RetrieverClient(settings.retriever_url, settings.top_k, search.timeout_s)
        else:
            self._search = index_host(settings.corpus, settings.top_k)

    def schemas(self) -> list[dict]:
        """The tools' OpenAI-style schemas, in config order (after `wait_ready`)."""
        self.wait_ready()
        return list(self._schemas)

    def worker_pids(self) -> list[int]:
        return self._pool.worker_pids() if self._pool is not None else []

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """One result per call, in order. All calls run at the same time; blocks until every one ended."""
        return [future.result() for future in self.submit(calls)]

    def submit(self, calls: list[ToolCall]) -> list[Future]:
        """One future per call, in order, each set to the call's `ToolResult` when it ends (at once for a
        call that cannot run: an unknown tool); returns at once, so the calls that are back can be used
        while the others run."""
        self.wait_ready()
        futures: list[Future] = [Future() for _ in calls]
        jobs, job_positions, queries, search_positions = [], [], [], []
        for position, call in enumerate(calls):
            index = self._index_by_name.get(call.name)
            if index is None:
                futures[position].set_result(
                    ToolResult.failed(
                        "unknown_tool",
                        f"Error: there is no tool {call.name!r}; the tools are: "
                        f"{', '.join(self._index_by_name) or 'none'}",
                    )
                )
            elif self.tools[index].function == SEARCH:
                query = call.arguments.get("query")
                if set(call.arguments) != {"query"} or not isinstance(query, str):
                    futures[position].set_result(
                        ToolResult.failed(
                            "raised",
                            f"Error: TypeError: {SEARCH} takes one argument, query (a string); got "
                            f"{one_line(repr(call.arguments))[:200]}",
                        )
                    )
                else:
                    queries.append(query)
                    search_positions.append(position)
            else:
                jobs.append((index, call.arguments, self.tools[index].timeout_s))
                job_positions.append(position)
        for position, future in zip(job_positions, self._pool.submit(jobs) if jobs else []):
            futures[position] = future
        if queries:
            for position, future in zip(search_positions, self._submit_search(queries)):
                futures[position] = future
        return futures

    def _submit_search(self, queries: list[str]) -> list[Future]:
        """The queries go to the search backend as one batch; one future per query, set when the batch
        answers or when the search's `timeout_s` has passed, whichever comes first."""
        if self._search is None:
            raise RuntimeError("ToolSet.submit got search calls before start_shared(); call it once Ray is up")
        timeout_s = next(tool.timeout_s for tool in self.tools if tool.function == SEARCH)
        futures = [Future() for _ in queries]
        started = time.monotonic()
        settling = threading.Lock()

        def settle(results: list[ToolResult]) -> None:  # the first of answer and deadline wins
            with settling:
                if not futures[0].done():
                    for future, result in zip(futures, results):
                        future.set_result(result)

        def time_out() -> None:
            settle(
                [
                    ToolResult.failed(
                        "timeout", f"Error: the search ran longer than {timeout_s:g} s", time.monotonic() - started
                    )
                ]
                * len(queries)
            )
            searching.cancel()

        searching = self._search.submit(queries)
        deadline = threading.Timer(timeout_s, time_out)
        deadline.daemon = True
        deadline.start()

        def answered(searching: Future) -> None:
            deadline.cancel()
            if not searching.cancelled():
                settle(self._search_results(searching, len(queries), started))

        searching.add_done_callback(answered)
        return futures

    @staticmethod
    def _search_results(searching: Future, count: int, started: float) -> list[ToolResult]:
        """The results of an answered search batch."""
        try:
            texts = searching.result()
        except Exception as error:  # the index's actor or the retrieval server failed: only these calls fail
            if _timed_out(error):  # the HTTP client's own limit (the same timeout_s) came before the deadline's
                return [
                    ToolResult.failed(
                        "timeout",
                        f"Error: the search ran longer than its time limit ({error})",
                        time.monotonic() - started,
                    )
                ] * count
            logger.warning("search failed for %d queries: %s", count, error)
            lines = str(error).strip().splitlines() or [""]
            text = one_line(f"Error: the search failed ({type(error).__name__}: {lines[-1]})")
            return [ToolResult.failed("raised", text, time.monotonic() - started)] * count
        latency = time.monotonic() - started
        return [ToolResult(text, None, latency) for text in texts]

    def close(self) -> None:
        """Stop the tool workers and the search backend; the ToolSet cannot be used afterwards."""
        if self._pool is not None:
            self._pool.close()
        if self._search is not None:
            self._search.close()
            self._search = None

    def __enter__(self) -> ToolSet:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _is_function_path(path: str) -> bool:
    module, _, function = path.partition(":")
    return bool(module) and bool(function)


def _timed_out(error: BaseException) -> bool:
    """A socket timeout, raised as is (while reading) or wrapped by urllib (while connecting)."""
    return isinstance(error, TimeoutError) or isinstance(getattr(error, "reason", None), TimeoutError)


def _python_tool_path(multi_turn: MultiTurnConfig, index: int) -> str:
    """The built-in python tool's function: on the SandboxFusion server where one is set (ToolError naming the
    key if it cannot run a tiny program), else the sandboxed one, or where this machine cannot build the
    sandbox, the unsandboxed one if the user allowed it (ToolError naming the key otherwise)."""
    url = multi_turn.python_tool.sandbox_fusion_url
    if url:
        problem = sandbox_fusion.server_problem(url)
        if problem is not None:
            raise ToolError(
                f"rollout.multi_turn.python_tool.sandbox_fusion_url = {url!r}: the server cannot run the "
                f"python tool's code ({problem}); start it (e.g. `docker run -p 8080:8080 "
                "volcengine/sandbox-fusion:server-20241204`), correct the URL, or empty it to run the "
                "code in the local sandbox"
            )
        return PYTHON_REMOTE
    problem = sandbox_problem()
    if problem is None:
        logger.info("the python tool runs model-written code in a sandbox built by %s", backend())
        return BUILTIN_TOOLS[PYTHON]
    if not multi_turn.python_tool.unsafe_no_sandbox:
        raise ToolError(
            f"rollout.multi_turn.tools[{index}].function = 'python': this machine cannot run model-written "
            f"code in its sandbox ({problem}); run where unprivileged user namespaces are allowed "
            "(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0; on Ubuntu 24.04 and "
            "later kernel.apparmor_restrict_unprivileged_userns=0; bubblewrap's `bwrap` or util-linux `unshare` "
            "on PATH), or run the code on a SandboxFusion server (rollout.multi_turn.python_tool.sandbox_fusion_url), "
            "or set rollout.multi_turn.python_tool.unsafe_no_sandbox: true to run it with your rights"
        )
    logger.warning(
        "the python tool runs model-written code WITHOUT a sandbox (%s), with your rights: "
        "rollout.multi_turn.python_tool.unsafe_no_sandbox is true",
        problem,
    )
    return PYTHON_UNSANDBOXED
