"""The built-in `search` tool: BM25 over a JSONL corpus (bm25s), or a Search-R1-style retrieval server.

Both answer a batch of queries at once (`search(queries) -> [observation, ...]`), so the `ToolSet`
sends all the search calls of one rollout turn in one request: to the one Ray actor that holds the
index (`megarl.orchestration.search_actor`), or to the retrieval server. The `search` function below
is the tool's signature and description as the model sees them; it is never called.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from megarl.tools.calls import ToolError

CORPUS_KEY = "rollout.multi_turn.search.corpus"
DOCUMENT_FIELDS = ("contents", "text")
"""A corpus line's document text, the first of these fields present."""
NO_RESULTS = "No documents found."


def search(query: str) -> str:
    """Search the document collection and return the most relevant documents.

    Args:
        query: What to look for, in a few keywords or a question.
    """
    raise RuntimeError("the built-in search runs in the ToolSet (megarl.tools.toolset), not in a tool worker")


def format_documents(documents: list[str]) -> str:
    """Search-R1's observation: `Doc 1: ...` one line per document, best first."""
    if not documents:
        return NO_RESULTS
    return "\n".join(f"Doc {rank}: {document}" for rank, document in enumerate(documents, start=1))


def read_corpus(path: str) -> list[str]:
    """The documents of a JSONL corpus, in file order. ToolError naming `CORPUS_KEY`, the file and the
    line for a missing file, a line that is not a JSON object, or one without a string document field."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ToolError(
            f'{CORPUS_KEY} = {path!r}: no such file; give the JSONL corpus (one {{"contents": ...}} '
            "per line) or set rollout.multi_turn.search.retriever_url instead"
        )
    documents = []
    with open(file, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ToolError(
                    f"{CORPUS_KEY} = {path!r}: line {number} is not JSON ({error}); each line must be "
                    'an object like {"contents": "..."}'
                ) from None
            text = next((record[name] for name in DOCUMENT_FIELDS if isinstance(record, dict) and name in record), None)
            if not isinstance(text, str):
                raise ToolError(
                    f"{CORPUS_KEY} = {path!r}: line {number} has no string field "
                    f"{' or '.join(DOCUMENT_FIELDS)}; put each document's text there"
                )
            documents.append(text)
    if not documents:
        raise ToolError(f"{CORPUS_KEY} = {path!r}: the file holds no documents; add one JSON object per line")
    return documents


class BM25Index:
    """A BM25 index (bm25s) of a JSONL corpus, built once; answers batches of queries."""

    def __init__(self, corpus: str, top_k: int):
        import bm25s  # only where the index lives (the search actor's process)

        self.documents = read_corpus(corpus)
        self.top_k = min(top_k, len(self.documents))
        self._bm25s = bm25s
        self.retriever = bm25s.BM25()
        self.retriever.index(self._tokenize(self.documents), show_progress=False)

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def __len__(self) -> int:
        return len(self.documents)

    def search(self, queries: list[str]) -> list[str]:
        """One observation per query: its best `top_k` documents (only those sharing a term with it)."""
        if not queries:
            return []
        ranks, scores = self.retriever.retrieve(self._tokenize(queries), k=self.top_k, show_progress=False)
        return [
            format_documents([self.documents[index] for index, score in zip(row, row_scores) if score > 0])
            for row, row_scores in zip(ranks.tolist(), scores.tolist())
        ]


class RetrieverClient:
    """A Search-R1 retrieval server (`search_r1/search/retrieval_server.py`): POST {"queries", "topk",
    "return_scores"} to its `/retrieve` URL; the reply's `result[i]` lists query i's documents as
    `{"document": {"contents": ...}, "score": ...}`."""

    def __init__(self, url: str, top_k: int, timeout_s: float):
        self.url, self.top_k, self.timeout_s = url, top_k, timeout_s
        self._requests = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megarl-retriever")

    def submit(self, queries: list[str]) -> Future:
        """`search(queries)` in the background (the ToolSet runs the other tools meanwhile)."""
        return self._requests.submit(self.search, queries)

    def close(self) -> None:
        self._requests.shutdown(wait=False, cancel_futures=True)

    def search(self, queries: list[str]) -> list[str]:
        if not queries:
            return []
        body = json.dumps({"queries": queries, "topk": self.top_k, "return_scores": True}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            reply = json.load(response)
        results = reply.get("result") if isinstance(reply, dict) else None
        if not isinstance(results, list) or len(results) != len(queries):
            raise ValueError(
                f"the retrieval server {self.url} answered {_excerpt(reply)}; expected "
                f'{{"result": [...]}} with one list of documents per query ({len(queries)})'
            )
        return [format_documents([_contents(item) for item in hits]) for hits in results]


def _contents(item) -> str:
    document = item.get("document", item) if isinstance(item, dict) else item
    if isinstance(document, dict):
        document = next((document[name] for name in DOCUMENT_FIELDS if name in document), document)
    return document if isinstance(document, str) else json.dumps(document)


def _excerpt(value, limit: int = 200) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."
