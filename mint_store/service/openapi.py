"""The OpenAPI 3.1 document of the service. A test holds it equal to the app's routes."""

from __future__ import annotations

import functools
from typing import Any

_ERR = {"$ref": "#/components/responses/Error"}
_JSON = "application/json"
_BYTES = {"200": {"description": "The row bytes", "content": {"application/octet-stream": {}}},
          "206": {"description": "One range of the row bytes", "content": {"application/octet-stream": {}}},
          "304": {"description": "Not modified (If-None-Match matched the content id)"},
          "416": _ERR}


def _p(name: str, where: str = "path", schema: dict[str, Any] | None = None, desc: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "in": where, "required": where == "path",
                           "schema": schema or {"type": "string"}}
    if desc:
        out["description"] = desc
    return out


_NAME = {"type": "string", "pattern": "^[a-z0-9][a-z0-9._-]{0,63}$"}
_TENANT, _ANAME = _p("tenant", schema=_NAME), _p("name", schema=_NAME)
_VERSION = _p("version", schema={"type": "integer", "minimum": 1})
_TAG = _p("tag", schema=_NAME)
_CID = {"type": "string", "pattern": "^[0-9a-f]{32}$"}
_RANGE = _p("Range", "header", desc="one byte range, e.g. bytes=0-1023")
_INM = _p("If-None-Match", "header", desc="the content id, quoted")


def _ok(desc: str, schema: str | None = None, status: str = "200") -> dict[str, Any]:
    body: dict[str, Any] = {"description": desc}
    if schema:
        body["content"] = {_JSON: {"schema": {"$ref": f"#/components/schemas/{schema}"}}}
    return {status: body, "400": _ERR, "401": _ERR, "403": _ERR, "404": _ERR}


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {_JSON: {"schema": schema}}}


def _op(summary: str, responses: dict[str, Any], params: list[dict[str, Any]] | None = None,
        body: dict[str, Any] | None = None, *, public: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": responses, "parameters": params or []}
    if body is not None:
        op["requestBody"] = body
    if public:
        op["security"] = []
    return op


def _paths() -> dict[str, dict[str, Any]]:
    row_params = [_TENANT, _ANAME, _VERSION, _RANGE, _INM]
    content = _op("Row bytes of a version (Range, ETag = content id)", {**_ok("row"), **_BYTES}, row_params)
    blob = _op("Row bytes by content id (Range, ETag = content id)", {**_ok("row"), **_BYTES},
               [_p("content_id", schema=_CID), _RANGE, _INM])
    upload = {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["adapter_config.json", "adapter_model.safetensors"],
        "properties": {"adapter_config.json": {"type": "string", "format": "binary"},
                       "adapter_model.safetensors": {"type": "string", "format": "binary"}}}}}}
    publish_resp = {**_ok("A new version (also when its bytes were deduplicated)", "PublishResult", "201"),
                    "408": _ERR, "413": _ERR, "415": _ERR, "422": _ERR}
    return {
        "/v1/adapters/{tenant}/{name}": {
            "put": _op("Publish a PEFT adapter (multipart upload)", publish_resp,
                       [_TENANT, _ANAME, _p("base", "query", _NAME), _p("tag", "query", _NAME)], upload),
            "get": _op("Metadata of the latest version", _ok("version", "VersionInfo"), [_TENANT, _ANAME]),
        },
        "/v1/adapters/{tenant}": {
            "get": _op("List adapter names", _ok("names", "NameList"), [
                _TENANT, _p("prefix", "query"), _p("after", "query", _NAME, "cursor: the last name seen"),
                _p("cursor", "query", _NAME, "same as after"),
                _p("limit", "query", {"type": "integer", "minimum": 1, "maximum": 1000})]),
        },
        "/v1/adapters/{tenant}/{name}/versions": {
            "get": _op("Versions in order, a page at a time (deleted ones flagged)", _ok("versions", "VersionList"), [
                _TENANT, _ANAME, _p("after", "query", {"type": "integer", "minimum": 0},
                                    "cursor: versions above this one (the last page's next)"),
                _p("limit", "query", {"type": "integer", "minimum": 1, "maximum": 1000})]),
        },
        "/v1/adapters/{tenant}/{name}/versions/{version}": {
            "get": _op("Metadata of one version", {**_ok("version", "VersionInfo"), "410": _ERR},
                       [_TENANT, _ANAME, _VERSION]),
            "delete": _op("Delete a version", {**_ok("deleted"), "409": _ERR}, [_TENANT, _ANAME, _VERSION]),
        },
        "/v1/adapters/{tenant}/{name}/versions/{version}/content": {
            "get": content, "head": {**content, "summary": "Headers of the row bytes"},
        },
        "/v1/adapters/{tenant}/{name}/versions/{version}/peft": {
            "get": _op("The version as PEFT files (a tar of adapter_config.json and adapter_model.safetensors)",
                       {**_ok("tar"), "410": _ERR}, [_TENANT, _ANAME, _VERSION]),
        },
        "/v1/adapters/{tenant}/{name}/tags/{tag}": {
            "get": _op("Metadata of the version a tag points at", _ok("version", "VersionInfo"),
                       [_TENANT, _ANAME, _TAG]),
            "put": _op("Move a tag to a version", {**_ok("tag"), "409": _ERR}, [_TENANT, _ANAME, _TAG],
                       _json_body({"type": "object", "required": ["version"],
                                   "properties": {"version": {"type": "integer", "minimum": 1}}})),
            "delete": _op("Remove a tag", _ok("removed"), [_TENANT, _ANAME, _TAG]),
        },
        "/v1/resolve": {
            "post": _op("Resolve up to 10,000 refs in one read transaction; errors in place",
                        _ok("results", "ResolveResults"), [],
                        _json_body({"type": "object", "required": ["refs"],
                                    "properties": {"refs": {"type": "array", "maxItems": 10000,
                                                            "items": {"type": "string"}}}})),
        },
        "/v1/blobs/{content_id}": {"get": blob, "head": {**blob, "summary": "Headers of the row bytes"}},
        "/v1/blobs/{content_id}/blocks": {
            "get": _op("Block digests of a row (16 bytes per block; 204: none recorded)", {**_ok("digests"), **_BYTES},
                       [_p("content_id", schema=_CID)]),
        },
        "/v1/layouts/{layout_id}": {
            "get": _op("The tensor table of a layout (a tenant token: only of its own live versions, else 404)",
                       _ok("layout"), [_p("layout_id", schema=_CID)]),
        },
        "/v1/bases/{base}": {
            "put": _op("Register a base's module shapes (admin)", {**_ok("registered", None, "201"), "409": _ERR},
                       [_p("base", schema=_NAME)],
                       _json_body({"type": "object", "additionalProperties": {
                           "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}})),
            "get": _op("A base's module shapes", _ok("shapes"), [_p("base", schema=_NAME)]),
        },
        "/v1/bases": {"get": _op("Registered bases with their module counts", _ok("bases", "BaseList"))},
        "/v1/events": {
            "get": _op("The change feed (long poll; a tenant token counts its own events only)",
                       _ok("events", "Events"), [
                _p("after", "query", {"type": "integer", "minimum": 0}, "the last seq seen (last_seq)"),
                _p("wait", "query", {"type": "number", "minimum": 0}, "seconds to wait for a commit"),
                _p("limit", "query", {"type": "integer", "minimum": 0, "maximum": 1000})]),
        },
        "/v1/admin/compact": {"post": _op("Run a compaction; ?grace=S also sweeps retired shards (admin)",
                                          {**_ok("report"), "400": _ERR})},
        "/v1/admin/stats": {"get": _op("Index statistics (admin)", _ok("stats"))},
        "/v1/local-socket": {"get": _op("This server's Unix socket of row copies into callers' memory on its "
                                        "machine, and the instance id its hello answers (404: none)",
                                        _ok("path and instance"))},
        "/healthz": {"get": _op("Health (last_seq and a replica's details: admin token or no token file)", {
            "200": {"description": "ok; or standby (mint serve --standby: writes go to writer_url)"}, "503": {
            "description": "degraded: the store takes no writes for now (reason in the body), or a replica is "
                           "not following the log (reason: log_gap or not_following)"}}, public=True)},
        "/metrics": {"get": _op("Prometheus metrics (admin: they sum every tenant's activity)",
                                {"200": {"description": "text exposition format", "content": {"text/plain": {}}}})},
        "/openapi.json": {"get": _op("This document", {"200": {"description": "OpenAPI 3.1"}}, public=True)},
    }


def _console_paths() -> dict[str, dict[str, Any]]:
    """Read-only routes for people (the web console) and the console's own files."""
    html = {"200": {"description": "the console (HTML, JavaScript, CSS)", "content": {"text/html": {}}}}
    return {
        "/v1/tenants": {"get": _op("Tenants this token may read (admin: every tenant with adapters), its role",
                                   _ok("tenants", "TenantList"))},
        "/v1/catalog/{tenant}": {"get": _op(
            "One summary per adapter: latest version, tags, base, rank, size, last publish",
            _ok("summaries", "Catalog"),
            [_TENANT, _p("prefix", "query"), _p("after", "query", _NAME, "cursor: the last name seen"),
             _p("limit", "query", {"type": "integer", "minimum": 1, "maximum": 1000})])},
        "/v1/admin/compaction": {"get": _op(
            "Compaction state: what would move now, retired shards awaiting the sweep, last runs (admin)",
            _ok("state"))},
        "/ui": {"get": _op("Redirect to /ui/", {"302": {"description": "to /ui/"}}, public=True)},
        "/ui/": {"get": _op("The web console", html, public=True)},
        "/ui/{asset}": {"get": _op("A file of the web console", {**html, "404": _ERR},
                                   [_p("asset")], public=True)},
    }


# a tenant token's seqs count the events it can see (its n-th is n); an admin's are the store's
_SEQ = {"type": "integer", "description": "the store's seq (admin); a tenant token's own count of its events"}


def _schemas() -> dict[str, Any]:
    s = {"type": "string"}
    i = {"type": "integer"}
    version_info = {"type": "object", "properties": {
        "tenant": s, "name": s, "version": i, "content_id": s, "layout_id": s, "nbytes": i, "base": s,
        "created": {"type": "number"}, "deleted": {"type": "boolean"}, "deduplicated": {"type": "boolean"},
        "tags": {"type": "array", "items": s}, "peft_config": {"type": ["object", "null"]}}}
    location = {"type": "object", "properties": {
        "content_id": s, "layout_id": s, "shard_key": s, "offset": i, "length": i, "row": i}}
    return {
        "Error": {"type": "object", "required": ["error", "message"],
                  "properties": {"error": s, "message": s}},
        "PublishResult": {"type": "object", "properties": {
            "tenant": s, "name": s, "version": i, "content_id": s, "layout_id": s, "nbytes": i,
            "deduplicated": {"type": "boolean"}, "seq": _SEQ, "upload_sha256": s}},
        "VersionInfo": version_info,
        "VersionList": {"type": "object", "properties": {"versions": {"type": "array", "items": version_info},
                                                         "next": {"type": ["integer", "null"]}}},
        "NameList": {"type": "object", "properties": {
            "tenant": s, "names": {"type": "array", "items": s}, "next": {"type": ["string", "null"]}}},
        "ResolveResults": {"type": "object", "properties": {"results": {"type": "array", "items": {
            "type": "object", "properties": {"ref": s, "location": location, "error": s, "message": s}}}}},
        "BaseList": {"type": "object", "properties": {"bases": {"type": "array", "items": {
            "type": "object", "properties": {"base": s, "modules": i}}}}},
        "TenantList": {"type": "object", "properties": {
            "tenants": {"type": "array", "items": s}, "role": s, "principal": s, "auth": {"type": "boolean"}}},
        "Catalog": {"type": "object", "properties": {"tenant": s, "next": {"type": ["string", "null"]},
                                                     "adapters": {"type": "array", "items": {"type": "object"}}}},
        "Events": {"type": "object", "properties": {
            "events": {"type": "array", "items": {"type": "object", "properties": {"seq": _SEQ}}},
            "last_seq": {**_SEQ, "description": "pass as the next after"},
            "head": {**_SEQ, "description": "the seq of the last event this token can see"}}},
    }


def _hub_paths() -> dict[str, dict[str, Any]]:
    """The Hugging Face Hub read protocol (mint_store/service/hub/routes.py); errors carry X-Error-Code."""
    repo = [_TENANT, _ANAME]
    rev = _p("revision", desc="main (latest), 7 or v7 (a version), a version's 40-hex commit id, or a tag")
    hub_err = {"401": _ERR, "404": _ERR}
    info = _op("Hub model info: sha = commit id, siblings = files", {"200": {"description": "model info"},
                                                                     **hub_err},
               [*repo, _p("blobs", "query", {"type": "boolean"}, "list sizes and LFS ids")])
    info_at = {**info, "parameters": [*info["parameters"], rev]}
    file_params = [*repo, rev, _p("filename", desc="adapter_config.json, adapter_model.safetensors, README.md"),
                   _RANGE, _p("If-None-Match", "header")]
    file_resp = {"200": {"description": "the file (ETag, X-Repo-Commit)"}, "206": {"description": "one range"},
                 "302": {"description": "any file at a moving revision: the same file at its commit"},
                 "304": {"description": "not modified"}, "416": _ERR, **hub_err}
    resolve = _op("Hub file download", file_resp, file_params)
    return {
        "/hf/api/models/{tenant}/{name}": {"get": info},
        "/hf/api/models/{tenant}/{name}/revision/{revision}": {"get": info_at},
        "/hf/api/models/{tenant}/{name}/tree/{revision}": {
            "get": _op("Hub file list of a revision", {"200": {"description": "tree entries"}, **hub_err},
                       [*repo, rev])},
        "/hf/{tenant}/{name}/resolve/{revision}/{filename}": {
            "get": resolve, "head": {**resolve, "summary": "Hub file metadata (headers only)"}},
    }


@functools.cache
def document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "MinT Store", "version": "1",
                 "description": "Content-addressed storage and streaming of LoRA adapters."},
        "paths": _paths() | _console_paths() | _hub_paths(),
        "components": {
            "schemas": _schemas(),
            "responses": {"Error": {"description": 'Every error: {"error": code, "message": text}',
                                    "content": {_JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
