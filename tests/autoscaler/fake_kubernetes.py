"""A local fake of the few Kubernetes API paths KubernetesProvider uses, over real HTTP.

It speaks the REST wire format (JSON objects, `kind: Status` errors with their reasons) so
the official client runs unchanged against it, keeps objects in memory with the server-set
metadata (`uid`, `resourceVersion`, `creationTimestamp`, `generation`), and records every
call. There is no controller: pods exist only when a test adds them, and a Scale's status
reports the requested replicas as if the ReplicaSet had caught up at once.

Paths and verbs are those of kubernetes.client (AppsV1Api, CoreV1Api):
  GET, POST         /apis/apps/v1/namespaces/{ns}/deployments          (list: ?labelSelector=)
  GET, PUT, DELETE  /apis/apps/v1/namespaces/{ns}/deployments/{name}
  PATCH             /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
  PATCH, DELETE     /api/v1/namespaces/{ns}/pods/{name}
  POST              /apis/policy/v1/namespaces/{ns}/poddisruptionbudgets
  GET, DELETE       /apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{name}
  POST              /apis/scheduling.k8s.io/v1/priorityclasses
  GET               /apis/scheduling.k8s.io/v1/priorityclasses/{name}
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

# Both are a JSON merge for the bodies the provider sends (maps only, no lists to merge by key).
PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")

_DEPLOYMENTS = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments$")
_DEPLOYMENT = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)$")
_SCALE = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
_BUDGETS = re.compile(r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets$")
_BUDGET = re.compile(r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets/([^/]+)$")
_PRIORITY_CLASSES = re.compile(r"^/apis/scheduling\.k8s\.io/v1/priorityclasses$")
_PRIORITY_CLASS = re.compile(r"^/apis/scheduling\.k8s\.io/v1/priorityclasses/([^/]+)$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "AlreadyExists",
    415: "UnsupportedMediaType",
    422: "Invalid",
    500: "InternalError",
}


@dataclass(slots=True)
class Call:
    method: str
    path: str
    query: dict[str, str]
    content_type: str | None
    body: Any  # parsed JSON, None without a body
    authorization: str | None


@dataclass(slots=True)
class _Failure:
    method: str
    path: str
    status: int
    message: str


class _Error(Exception):
    def __init__(self, status: int, message: str, reason: str | None = None, details: dict | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason or _REASONS.get(status, "Unknown")
        self.details = details or {}

    def status_object(self) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": str(self),
            "reason": self.reason,
            "details": self.details,
            "code": self.status,
        }


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: maps merge key by key, null removes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, selector.split(",")):
        key, sep, value = term.partition("=")
        if not sep:
            raise _Error(400, f"unable to parse requirement: {term!r} (the fake supports key=value only)")
        if labels.get(key.strip()) != value.lstrip("=").strip():
            return False
    return True


@dataclass(slots=True)
class FakeKubernetes:
    """Start with `start()`, point a client at `url`, read `calls`; `token` is required when set."""

    token: str | None = None
    calls: list[Call] = field(default_factory=list)
    deployments: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    budgets: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    priority_classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: list[_Failure] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 1000
    server: ThreadingHTTPServer | None = None
    thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self.server is not None, "start() first"
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeKubernetes:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as urllib3's pool expects

            def _handle(self) -> None:
                fake._serve(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, args=(0.05,), name="fake-kubernetes", daemon=True
        )
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        if self.thread is not None:
            self.thread.join(5)

    # --- test helpers -------------------------------------------------------------------

    def fail_next(self, method: str, path: str, status: int, message: str = "injected failure") -> None:
        """The next `method` on `path` answers `status` (a Status object) instead."""
        with self.lock:
            self.failures.append(_Failure(method, path, status, message))

    def add_deployment(self, body: dict[str, Any]) -> dict[str, Any]:
        """Store a Deployment as if someone else had created it."""
        with self.lock:
            return self._create_deployment(body["metadata"]["namespace"], copy.deepcopy(body))

    def add_pod(self, namespace: str, name: str, labels: dict[str, str] | None = None) -> None:
        with self.lock:
            self.pods[namespace, name] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": self._new_metadata(namespace, name, labels or {}),
            }

    # --- the server ---------------------------------------------------------------------

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        url = urlsplit(request.path)
        query = dict(parse_qsl(url.query))
        length = int(request.headers.get("Content-Length") or 0)
        raw = request.rfile.read(length) if length else b""
        content_type = request.headers.get("Content-Type")
        body = json.loads(raw) if raw else None
        call = Call(
            request.command, url.path, query, content_type, body, request.headers.get("Authorization")
        )
        try:
            with self.lock:
                self.calls.append(call)
                status, answer = self._route(call)
        except _Error as exc:
            status, answer = exc.status, exc.status_object()
        data = json.dumps(answer).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def _route(self, call: Call) -> tuple[int, dict[str, Any]]:
        if self.token is not None and call.authorization != f"Bearer {self.token}":
            raise _Error(401, "Unauthorized")
        for failure in self.failures:
            if (failure.method, failure.path) == (call.method, call.path):
                self.failures.remove(failure)
                raise _Error(failure.status, failure.message)
        method = call.method
        if match := _DEPLOYMENTS.match(call.path):
            (ns,) = match.groups()
            if method == "GET":
                return 200, self._list_deployments(ns, call.query.get("labelSelector", ""))
            if method == "POST":
                return 201, self._create_deployment(ns, self._json_body(call))
        elif match := _DEPLOYMENT.match(call.path):
            ns, name = match.groups()
            if method == "GET":
                return 200, self._deployment(ns, name)
            if method == "PUT":
                return 200, self._replace_deployment(ns, name, self._json_body(call))
            if method == "DELETE":
                return 200, self._delete_deployment(ns, name)
        elif match := _SCALE.match(call.path):
            ns, name = match.groups()
            if method == "PATCH":
                return 200, self._patch_scale(ns, name, self._patch_body(call))
        elif match := _POD.match(call.path):
            ns, name = match.groups()
            if method == "PATCH":
                return 200, self._patch_pod(ns, name, self._patch_body(call))
            if method == "DELETE":
                return 200, self._delete_pod(ns, name)
        elif match := _BUDGETS.match(call.path):
            (ns,) = match.groups()
            if method == "POST":
                return 201, self._create_budget(ns, self._json_body(call))
        elif match := _BUDGET.match(call.path):
            ns, name = match.groups()
            if method == "GET":
                return 200, self._named(self.budgets, (ns, name), "poddisruptionbudgets", "policy")
            if method == "DELETE":
                obj = self._named(self.budgets, (ns, name), "poddisruptionbudgets", "policy")
                del self.budgets[ns, name]
                return 200, obj
        elif _PRIORITY_CLASSES.match(call.path):
            if method == "POST":
                return 201, self._create_priority_class(self._json_body(call))
        elif match := _PRIORITY_CLASS.match(call.path):
            (name,) = match.groups()
            if method == "GET":
                return 200, self._named(self.priority_classes, name, "priorityclasses", "scheduling.k8s.io")
        else:
            raise _Error(404, "the server could not find the requested resource")
        raise _Error(405, f"{method} is not supported on {call.path}")

    @staticmethod
    def _json_body(call: Call) -> dict[str, Any]:
        # Without a Content-Type the API server decodes its first supported type, JSON (the
        # client sends create and replace bodies without one).
        if call.content_type not in (None, "application/json") or not isinstance(call.body, dict):
            raise _Error(415, f"expected a JSON object, got {call.content_type}")
        return call.body

    @staticmethod
    def _patch_body(call: Call) -> dict[str, Any]:
        if call.content_type not in PATCH_TYPES or not isinstance(call.body, dict):
            raise _Error(415, f"the fake does not accept {call.content_type} patches")
        return call.body

    def _new_metadata(self, ns: str, name: str, labels: dict[str, str]) -> dict[str, Any]:
        self.version += 1
        return {
            "name": name,
            "namespace": ns,
            "uid": str(uuid.uuid4()),
            "resourceVersion": str(self.version),
            "generation": 1,
            "creationTimestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "labels": labels,
        }

    def _get(
        self, store: dict[tuple[str, str], dict[str, Any]], kind: str, ns: str, name: str
    ) -> dict[str, Any]:
        obj = store.get((ns, name))
        if obj is None:
            group = "apps" if kind == "deployments" else ""
            qualified = f"{kind}.{group}" if group else kind
            raise _Error(
                404, f'{qualified} "{name}" not found', details={"name": name, "group": group, "kind": kind}
            )
        return obj

    def _deployment(self, ns: str, name: str) -> dict[str, Any]:
        return self._get(self.deployments, "deployments", ns, name)

    def _list_deployments(self, ns: str, selector: str) -> dict[str, Any]:
        items = []
        for (item_ns, _), obj in sorted(self.deployments.items()):
            if item_ns == ns and _selector_matches(selector, obj["metadata"].get("labels") or {}):
                # List items carry neither apiVersion nor kind, as on a real server.
                items.append({k: v for k, v in obj.items() if k not in ("apiVersion", "kind")})
        return {
            "apiVersion": "apps/v1",
            "kind": "DeploymentList",
            "metadata": {"resourceVersion": str(self.version)},
            "items": items,
        }

    def _validate(self, ns: str, body: dict[str, Any]) -> str:
        if (body.get("apiVersion"), body.get("kind")) != ("apps/v1", "Deployment"):
            raise _Error(400, "expected an apps/v1 Deployment")
        metadata = body.get("metadata") or {}
        name = metadata.get("name") or ""
        if metadata.get("namespace", ns) != ns:
            raise _Error(400, "the namespace of the object does not match the namespace on the request")
        if not _SUBDOMAIN.match(name) or len(name) > 253:
            raise _Error(422, f'Deployment.apps "{name}" is invalid: metadata.name')
        spec = body.get("spec") or {}
        selector = (spec.get("selector") or {}).get("matchLabels") or {}
        labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            raise _Error(422, f'Deployment.apps "{name}" is invalid: selector does not match template labels')
        return name

    def _create_deployment(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        name = self._validate(ns, body)
        if (ns, name) in self.deployments:
            raise _Error(
                409,
                f'deployments.apps "{name}" already exists',
                details={"name": name, "group": "apps", "kind": "deployments"},
            )
        obj = copy.deepcopy(body)
        obj["metadata"] = {
            **obj["metadata"],
            **self._new_metadata(ns, name, obj["metadata"].get("labels") or {}),
        }
        obj["spec"].setdefault("replicas", 1)  # the API server's default
        obj["status"] = {}
        self.deployments[ns, name] = obj
        return obj

    def _replace_deployment(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        old = self._deployment(ns, name)
        if self._validate(ns, body) != name:
            raise _Error(400, "the name of the object does not match the name on the URL")
        version = body["metadata"].get("resourceVersion")
        if version is not None and version != old["metadata"]["resourceVersion"]:
            raise _Error(409, "the object has been modified", reason="Conflict")
        obj = copy.deepcopy(body)
        self.version += 1
        kept = {k: old["metadata"][k] for k in ("uid", "creationTimestamp", "generation")}
        obj["metadata"] = {**obj["metadata"], **kept, "namespace": ns, "resourceVersion": str(self.version)}
        obj["spec"].setdefault("replicas", 1)
        if obj["spec"] != old["spec"]:
            obj["metadata"]["generation"] += 1
        obj["status"] = old.get("status", {})
        self.deployments[ns, name] = obj
        return obj

    def _delete_deployment(self, ns: str, name: str) -> dict[str, Any]:
        obj = self._deployment(ns, name)
        del self.deployments[ns, name]
        # Background propagation: the object goes at once, its ReplicaSets and pods later.
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {"name": name, "group": "apps", "kind": "deployments", "uid": obj["metadata"]["uid"]},
        }

    def _patch_scale(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        obj = self._deployment(ns, name)
        scale = merge_patch({"spec": {"replicas": obj["spec"].get("replicas", 1)}}, patch)
        replicas = scale.get("spec", {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise _Error(422, f'Scale.autoscaling "{name}" is invalid: spec.replicas')
        if replicas != obj["spec"].get("replicas"):
            obj["spec"]["replicas"] = replicas
            obj["metadata"]["generation"] += 1
            self.version += 1
            obj["metadata"]["resourceVersion"] = str(self.version)
        selector = ",".join(f"{k}={v}" for k, v in sorted(obj["spec"]["selector"]["matchLabels"].items()))
        meta = obj["metadata"]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            },
            "spec": {"replicas": replicas},
            "status": {"replicas": replicas, "selector": selector},
        }

    def _patch_pod(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        pod = self._get(self.pods, "pods", ns, name)
        patched = merge_patch(pod, patch)
        for key in ("name", "namespace", "uid", "creationTimestamp"):  # not the patch's to change
            patched["metadata"][key] = pod["metadata"][key]
        self.version += 1
        patched["metadata"]["resourceVersion"] = str(self.version)
        self.pods[ns, name] = patched
        return patched

    def _delete_pod(self, ns: str, name: str) -> dict[str, Any]:
        # A real pod lingers while terminating (the worker drains); the fake drops it at once.
        pod = self.pods.pop((ns, name), None) or self._get(self.pods, "pods", ns, name)
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        pod["metadata"] = {**pod["metadata"], "deletionTimestamp": now}
        return pod

    # --- PodDisruptionBudgets and PriorityClasses: stored, nothing more --------------------

    @staticmethod
    def _named(store: dict[Any, dict[str, Any]], key: Any, kind: str, group: str) -> dict[str, Any]:
        obj = store.get(key)
        if obj is None:
            name = key[-1] if isinstance(key, tuple) else key
            raise _Error(
                404,
                f'{kind}.{group} "{name}" not found',
                details={"name": name, "group": group, "kind": kind},
            )
        return obj

    def _create_budget(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        if (body.get("apiVersion"), body.get("kind")) != ("policy/v1", "PodDisruptionBudget"):
            raise _Error(400, "expected a policy/v1 PodDisruptionBudget")
        name = body["metadata"]["name"]
        if body["metadata"].get("namespace", ns) != ns:
            raise _Error(400, "the namespace of the object does not match the namespace on the request")
        spec = body.get("spec") or {}
        if ("minAvailable" in spec) == ("maxUnavailable" in spec) or not spec.get("selector"):
            raise _Error(422, f'PodDisruptionBudget.policy "{name}" is invalid')
        if (ns, name) in self.budgets:
            raise _Error(409, f'poddisruptionbudgets.policy "{name}" already exists')
        obj = copy.deepcopy(body)
        obj["metadata"] = {
            **obj["metadata"],
            **self._new_metadata(ns, name, obj["metadata"].get("labels") or {}),
        }
        self.budgets[ns, name] = obj
        return obj

    def _create_priority_class(self, body: dict[str, Any]) -> dict[str, Any]:
        if (body.get("apiVersion"), body.get("kind")) != ("scheduling.k8s.io/v1", "PriorityClass"):
            raise _Error(400, "expected a scheduling.k8s.io/v1 PriorityClass")
        name = body["metadata"]["name"]
        if not isinstance(body.get("value"), int) or body["value"] > 1_000_000_000:
            raise _Error(422, f'PriorityClass.scheduling.k8s.io "{name}" is invalid: value')
        if name in self.priority_classes:
            raise _Error(409, f'priorityclasses.scheduling.k8s.io "{name}" already exists')
        obj = copy.deepcopy(body)
        metadata = self._new_metadata("", name, obj["metadata"].get("labels") or {})
        metadata.pop("namespace")
        obj["metadata"] = {**obj["metadata"], **metadata}
        self.priority_classes[name] = obj
        return obj
