"""A local stand-in for the Hugging Face Hub's upload API, for push tests without the network.

It answers the calls huggingface_hub's normal upload path makes (create_repo, validate-yaml, preupload,
the LFS batch API with basic transfers, the PUT of each LFS object, and the ndjson commit) and stores
each committed file under `root/<repo_id>/`, so a test can assert what arrived and load it. Any other
request is answered 404 and listed in `unexpected`. Point a client at it with HF_ENDPOINT and
HF_HUB_DISABLE_XET=1 (the Xet protocol needs Hugging Face's storage service; the LFS path is the one
huggingface_hub uses wherever Xet is not available).
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class HubStandIn:
    def __init__(self, root: Path) -> None:
        self.root, self.blobs = root, root / ".lfs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.repos: set[str] = set()
        self.commits: list[dict[str, Any]] = []
        self.unexpected: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "HubStandIn":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo_id: str) -> list[str]:
        folder = self.root / repo_id
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def hub_env(hub: HubStandIn) -> dict[str, str]:
    """The environment that points huggingface_hub (in this process's children) at the stand-in."""
    return {"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "hf_stand_in_token"}


def _handler(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep test output quiet
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = b""
                while True:
                    size = int(self.rfile.readline().strip(), 16)
                    chunk = self.rfile.read(size)
                    self.rfile.readline()
                    if size == 0:
                        return data
                    data += chunk
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _reply(self, status: int, payload: Any = None) -> None:
            body = json.dumps(payload if payload is not None else {}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            body, path = self._body(), self.path.split("?")[0]
            if path == "/api/repos/create":
                request = json.loads(body)
                repo_id = f"{request.get('organization') or 'user'}/{request['name']}"
                hub.repos.add(repo_id)
                return self._reply(200, {"url": f"{hub.endpoint}/{repo_id}"})
            if path == "/api/validate-yaml":
                return self._reply(200, {"errors": [], "warnings": []})
            if m := re.fullmatch(r"/api/models/(.+)/preupload/([^/]+)", path):
                files = json.loads(body)["files"]
                return self._reply(200, {"files": [
                    {"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES) else "regular",
                     "shouldIgnore": False} for f in files]})
            if m := re.fullmatch(r"/(.+)\.git/info/lfs/objects/batch", path):
                objects = json.loads(body)["objects"]
                return self._reply(200, {"transfer": "basic", "objects": [
                    {"oid": o["oid"], "size": o["size"], "authenticated": True,
                     "actions": {"upload": {"href": f"{hub.endpoint}/lfs-upload/{o['oid']}"}}} for o in objects]})
            if m := re.fullmatch(r"/api/models/(.+)/commit/([^/]+)", path):
                return self._commit(m.group(1), body)
            hub.unexpected.append(f"POST {self.path}")
            self._reply(404, {"error": "not served by the stand-in"})

        def do_PUT(self) -> None:
            body = self._body()
            if m := re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", self.path):
                if hashlib.sha256(body).hexdigest() != m.group(1):
                    return self._reply(400, {"error": "content does not match its oid"})
                (hub.blobs / m.group(1)).write_bytes(body)
                return self._reply(200)
            hub.unexpected.append(f"PUT {self.path}")
            self._reply(404)

        def do_GET(self) -> None:
            if self.path == "/api/agent-harnesses":  # the client's user-agent registry: nothing registered
                return self._reply(200, {"standardEnvVars": [], "harnesses": {}})
            hub.unexpected.append(f"GET {self.path}")
            self._reply(404, {"error": "not served by the stand-in"})

        do_HEAD = do_GET

        def _commit(self, repo_id: str, body: bytes) -> None:
            if repo_id not in hub.repos:
                return self._reply(404, {"error": f"repository {repo_id} not found"})
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            written = []
            for line in lines[1:]:
                value = line["value"]
                target = hub.root / repo_id / value["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                if line["key"] == "file":
                    target.write_bytes(base64.b64decode(value["content"]))
                elif line["key"] == "lfsFile":
                    blob = hub.blobs / value["oid"]
                    if not blob.is_file():
                        return self._reply(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                    target.write_bytes(blob.read_bytes())
                written.append(value["path"])
            oid = hashlib.sha1(body).hexdigest()
            hub.commits.append({"repo_id": repo_id, "summary": lines[0]["value"]["summary"], "files": written})
            self._reply(200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid,
                              "pullRequestUrl": None})

    return Handler
