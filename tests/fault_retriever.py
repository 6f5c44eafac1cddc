"""A Search-R1 retriever server on 127.0.0.1 that fails on a schedule, for the tool-health tests.

`FaultyRetriever(documents, schedule)` answers `POST /retrieve` from a BM25 index of
`documents`, except that request n (counted from 0) meets `schedule[n % len(schedule)]`:
None answers, "5xx" is a 503, "reset" closes the connection without a reply (a TCP reset),
"hang" answers nothing until the client gives up, "slow" answers after `slow_s`, "malformed"
answers 200 with JSON cut in the middle. `stop()` closes the port (connection refused) and
`start()` opens the same port again.
"""

import http.server
import json
import socket
import struct
import threading

from mgrpo_jax.envs import retrieval

KINDS = (None, "5xx", "reset", "hang", "slow", "malformed")


def send_json(handler: http.server.BaseHTTPRequestHandler, data: bytes) -> None:
  """A 200 reply of JSON `data` (bytes), as a Search-R1 server sends it."""
  handler.send_response(200)
  handler.send_header("Content-Type", "application/json")
  handler.send_header("Content-Length", str(len(data)))
  handler.end_headers()
  handler.wfile.write(data)


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.0"

  def do_POST(self):  # noqa: N802 - the http.server hook's name
    srv = self.server.owner
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    kind = srv.next_kind(body)
    if kind == "5xx":
      self.send_error(503)
    elif kind == "reset":
      # SO_LINGER 0: close() sends a reset instead of an orderly end of the stream.
      self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
      self.connection.close()
      self.close_connection = True
    elif kind == "hang":
      srv.stopping.wait(srv.hang_s)  # Bounded, so the server always shuts down.
      self.close_connection = True
    elif kind == "malformed":
      send_json(self, b'{"result": [[{"document": {"id": "x", "con')
    else:
      if kind == "slow":
        srv.stopping.wait(srv.slow_s)
      answers = [srv.answer(q, body["topk"]) for q in body["queries"]]
      send_json(self, json.dumps({"result": answers}).encode())

  def log_message(self, *args):
    del args


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def handle_error(self, request, client_address):
    del request, client_address  # A reset or a client that gave up: expected here.


class FaultyRetriever:
  """The server (see the module doc); `requests` lists (query, kind) as they came."""

  def __init__(self, documents, schedule=(None,), *, hang_s: float = 5.0, slow_s: float = 0.2,
               port: int = 0):
    assert all(k in KINDS for k in schedule), schedule
    self.index = retrieval.Bm25Retriever.from_documents(documents)
    self.schedule, self.hang_s, self.slow_s = list(schedule), hang_s, slow_s
    self.requests, self._lock = [], threading.Lock()
    self.stopping = threading.Event()
    self.port, self._server = port, None
    self.start()

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.port}/retrieve"

  def next_kind(self, body) -> str | None:
    with self._lock:
      kind = self.schedule[len(self.requests) % len(self.schedule)]
      self.requests.append((body["queries"][0], kind))
    return kind

  def answer(self, query: str, k: int) -> list:
    hits = self.index.search(query, k)
    return [{"document": retrieval.to_record(self.index.lookup(h.doc_id)), "score": h.score}
            for h in hits]

  def start(self) -> "FaultyRetriever":
    self.stopping.clear()
    self._server = _Server(("127.0.0.1", self.port), _Handler)  # Loopback only.
    self._server.owner = self
    self.port = self._server.server_port
    threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
    return self

  def stop(self) -> None:
    """Closes the port: later requests are refused."""
    if self._server is not None:
      self.stopping.set()
      self._server.shutdown()
      self._server.server_close()
      self._server = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()


def free_port() -> int:
  """A port nothing listens on (bound and released)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
