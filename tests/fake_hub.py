"""A local stand-in for the Hugging Face Hub (127.0.0.1 only) with the endpoints huggingface_hub
2.x calls for `snapshot_download` / `hf_hub_download`:

- GET  /api/models/{org}/{name}/revision/{rev}   repo info: id, sha, siblings
- GET  /api/models/{org}/{name}/tree/{rev}       the file listing (path, size, oid, lfs)
- HEAD /{org}/{name}/resolve/{rev}/{path}        X-Repo-Commit, ETag / X-Linked-Etag, sizes
- GET  /{org}/{name}/resolve/{rev}/{path}        the bytes, honouring `Range: bytes=N-`

Every request is recorded (method, path, headers) so tests can assert what was fetched, with
which token and which Range. `cut_once` names files whose first GET stops half way (the
connection is dropped), to exercise huggingface_hub's resume.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading

from aiohttp import web
from multidict import CIMultiDict


class FakeHub:
    def __init__(self):
        # repo -> revision name -> (commit sha, {path: bytes}); "main" is the default branch.
        self.repos: dict[str, dict[str, tuple[str, dict[str, bytes]]]] = {}
        self.requests: list[tuple[str, str, CIMultiDict]] = []   # header names any case
        self.cut_once: set[str] = set()
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None

    def add(self, repo: str, files: dict[str, bytes], revision: str = "main") -> str:
        sha = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
        self.repos.setdefault(repo, {})[revision] = (sha, files)
        return sha

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> FakeHub:
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self._loop)
            app = web.Application()
            app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._info)
            app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self._tree)
            app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{path:.+}", self._resolve)
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        async def close():
            await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    # -- handlers ----------------------------------------------------------------------------------
    def _find(self, request: web.Request):
        self.requests.append((request.method, request.path, CIMultiDict(request.headers)))
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        rev = request.match_info["rev"]
        for name, (sha, files) in self.repos.get(repo, {}).items():
            if rev in (name, sha):
                return repo, sha, files
        if repo not in self.repos:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"}, text="Repository not found")
        raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"}, text="Revision not found")

    async def _info(self, request: web.Request) -> web.Response:
        repo, sha, files = self._find(request)
        return web.json_response({"id": repo, "modelId": repo, "sha": sha, "private": False,
                                  "siblings": [{"rfilename": p} for p in files]})

    async def _tree(self, request: web.Request) -> web.Response:
        _, _, files = self._find(request)
        entries = []
        for path, data in files.items():
            entry = {"type": "file", "path": path, "size": len(data), "oid": _git_oid(data)}
            if _is_lfs(path):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                "pointerSize": 130}
            entries.append(entry)
        return web.json_response(entries)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        _, sha, files = self._find(request)
        path = request.match_info["path"]
        if path not in files:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"}, text="Entry not found")
        data = files[path]
        etag = hashlib.sha256(data).hexdigest() if _is_lfs(path) else _git_oid(data)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if _is_lfs(path):
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(len(data))
        if request.method == "HEAD":
            headers["Content-Length"] = str(len(data))
            return web.Response(headers=headers)
        start, status = 0, 200
        ranged = request.headers.get("Range", "")
        if ranged.startswith("bytes="):
            start = int(ranged[6:].split("-")[0])
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        if path in self.cut_once and start == 0:
            self.cut_once.discard(path)
            response = web.StreamResponse(status=status, headers=headers)
            response.content_length = len(body)
            await response.prepare(request)
            await response.write(body[:len(body) // 2])
            await asyncio.sleep(0.05)
            request.transport.close()       # the connection drops mid-file
            return response
        return web.Response(status=status, body=body, headers=headers)


def _is_lfs(path: str) -> bool:
    return path.endswith((".safetensors", ".gguf"))


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
