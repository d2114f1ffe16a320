"""The built-in search: a bm25s index in one Ray actor (best document first, one batch per run, corpus errors named
by file and line), and a Search-R1 retrieval server over HTTP (its request format, timeouts)."""

import json
import socket
import threading
import time
import urllib.error
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from megarl.config.rollout import MultiTurnConfig, SearchConfig, ToolConfig
from megarl.orchestration.cluster import init_ray, shutdown_ray
from megarl.orchestration.search_actor import SearchActor
from megarl.tools import ToolCall, ToolError, ToolSet
from megarl.tools.builtin.search import read_corpus

DOCUMENTS = [
    {"id": "1", "contents": "Paris\nParis is the capital and largest city of France."},
    {"id": "2", "contents": "Mount Everest\nEverest is the highest mountain above sea level, in the Himalayas."},
    {"id": "3", "text": "Photosynthesis\nPlants turn light, water and carbon dioxide into sugar and oxygen."},
    {"id": "4", "contents": "Berlin\nBerlin is the capital of Germany."},
]


def write_corpus(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def search_tools(timeout_s: float = 30.0, **search) -> ToolSet:
    tools = (ToolConfig("search", timeout_s=timeout_s), ToolConfig("calculator"))
    return ToolSet(MultiTurnConfig(enable=True, tools=tools, search=SearchConfig(top_k=2, **search)))


@pytest.fixture(scope="module")
def ray_cluster():
    init_ray(num_cpus=1)
    yield
    shutdown_ray()


def test_bm25_ranks_the_right_document_first_for_each_query_of_a_batch(ray_cluster, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl", DOCUMENTS)
    with search_tools(corpus=corpus) as tools:
        tools.wait_ready()
        tools.start_shared(SearchActor)
        assert [schema["function"]["name"] for schema in tools.schemas()] == ["search", "calculator"]
        results = tools.run(
            [
                ToolCall("search", {"query": "highest mountain"}),
                ToolCall("calculator", {"expression": "6 * 7"}),
                ToolCall("search", {"query": "capital of Germany"}),
                ToolCall("search", {"query": "plants sugar"}),
                ToolCall("search", {"query": "zebra quantum"}),
                ToolCall("search", {"q": "capital"}),
            ]
        )
        assert [result.error for result in results] == [None, None, None, None, None, "raised"]
        assert results[0].text.startswith("Doc 1: " + DOCUMENTS[1]["contents"])
        assert results[1].text == "42"
        # Both capitals share "capital"; Germany's ranks first, and top_k = 2 keeps two documents.
        assert results[2].text == f"Doc 1: {DOCUMENTS[3]['contents']}\nDoc 2: {DOCUMENTS[0]['contents']}"
        assert results[3].text == f"Doc 1: {DOCUMENTS[2]['text']}"
        assert results[4].text == "No documents found."
        assert results[5].text.startswith("Error: TypeError: search takes one argument, query (a string)")


def test_a_bad_corpus_line_is_named_when_the_index_is_built(ray_cluster, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps(DOCUMENTS[0]) + "\n{not json\n")
    with search_tools(corpus=str(corpus)) as tools:
        tools.wait_ready()
        with pytest.raises(ToolError, match=rf"rollout.multi_turn.search.corpus = '{corpus}': line 2 is not JSON"):
            tools.start_shared(SearchActor)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, r"no such file; give the JSONL corpus"),
        ('{"contents": "a"}\n\n{"title": "b"}\n', r"line 3 has no string field contents or text"),
        ('{"contents": "a"}\n[1, 2]\n', r"line 2 has no string field contents or text"),
        ("\n", r"the file holds no documents"),
    ],
)
def test_corpus_errors_name_the_setting_the_file_and_the_line(tmp_path, content, message):
    path = tmp_path / "corpus.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ToolError, match=rf"^rollout.multi_turn.search.corpus = '{path}': {message}"):
        read_corpus(str(path))


class Retriever(BaseHTTPRequestHandler):
    """A Search-R1 retrieval server: answers POST /retrieve; a query "hang" blocks until `release` is set."""

    requests: ClassVar[list] = []
    release = threading.Event()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Retriever.requests.append((self.path, body))
        if "hang" in body["queries"]:
            Retriever.release.wait()
        result = [
            [
                {"document": {"id": str(rank), "contents": f"{query} result {rank}"}, "score": 1.0 / (rank + 1)}
                for rank in range(body["topk"])
            ]
            for query in body["queries"]
        ]
        reply = json.dumps({"result": result}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def retriever_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Retriever)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Retriever.requests.clear()
    Retriever.release.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    Retriever.release.set()
    server.shutdown()
    server.server_close()


def test_a_retrieval_server_gets_the_batch_of_queries_in_one_request(retriever_url):
    with search_tools(retriever_url=retriever_url) as tools:
        tools.wait_ready()
        tools.start_shared(SearchActor)
        results = tools.run(
            [
                ToolCall("search", {"query": "alpha"}),
                ToolCall("calculator", {"expression": "1+1"}),
                ToolCall("search", {"query": "beta"}),
            ]
        )
    assert Retriever.requests == [("/retrieve", {"queries": ["alpha", "beta"], "topk": 2, "return_scores": True})]
    assert [result.text for result in results] == [
        "Doc 1: alpha result 0\nDoc 2: alpha result 1",
        "2",
        "Doc 1: beta result 0\nDoc 2: beta result 1",
    ]


def test_a_retrieval_server_past_the_time_limit_is_a_timeout(retriever_url):
    with search_tools(retriever_url=retriever_url, timeout_s=0.5) as tools:
        tools.wait_ready()
        tools.start_shared(SearchActor)
        (hung,) = tools.run([ToolCall("search", {"query": "hang"})])
        assert hung.error == "timeout" and hung.latency_s >= 0.5
        Retriever.release.set()


def test_an_unreachable_retrieval_server_is_a_raised_result():
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with search_tools(retriever_url=f"http://127.0.0.1:{port}/retrieve") as tools:
        tools.wait_ready()
        tools.start_shared(SearchActor)
        (result,) = tools.run([ToolCall("search", {"query": "x"})])
    assert result.error == "raised"
    assert result.text.startswith("Error: the search failed (URLError: <urlopen error [Errno 111] Connection refused>")


@pytest.mark.parametrize("error", [TimeoutError("timed out"), urllib.error.URLError(TimeoutError("timed out"))])
def test_the_http_clients_own_timeout_is_a_timeout_too(error):
    """The retrieval client's socket limit is the search's timeout_s too, so under load it can come before
    the ToolSet's deadline: a socket timeout (while reading, or wrapped by urllib while connecting) is
    counted as a timeout, not as a raised search."""
    failed = Future()
    failed.set_exception(error)
    (result,) = ToolSet._search_results(failed, 1, time.monotonic())
    assert result.error == "timeout" and result.text.startswith("Error: the search ran longer than its time limit")
