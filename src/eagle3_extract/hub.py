"""Is the Hugging Face hub reachable? Asked once, in seconds, before a hub name is used.

Without network, `datasets` and `transformers` retry a hub name for half a minute and
print a screenful of warnings before their error; with HF_HUB_OFFLINE=1 they fail at
once but name no fix. A hub name (dataset or model) goes through `require_hub` first:
offline mode set, or no TCP connection to the hub (or to the HTTPS proxy) within
PROBE_S, means one line that names the fixes, unless the local HF cache already has
it, in which case this process switches to offline mode and reads the cache.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

from eagle3_extract.errors import PreflightError

PROBE_S = 3.0
_OFFLINE_VALUES = {"1", "ON", "YES", "TRUE"}
# what the hub takes for a repo id: "name" or "org/name" (a path like /data/x or ./x is not)
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_reachable: dict[str, bool] = {}


def offline_mode() -> bool:
    return any(os.environ.get(k, "").upper() in _OFFLINE_VALUES
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


def _target() -> tuple[str, int]:
    """Where a connection to the hub goes first: the HTTPS proxy if one is set."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme != "http" else 80)


def reachable(timeout: float = PROBE_S) -> bool:
    """A TCP connection to the hub (or the proxy) within `timeout` s, name lookup
    included (a thread: `getaddrinfo` itself has no timeout)."""
    host, port = _target()
    key = f"{host}:{port}"
    if key not in _reachable:
        ok: list[bool] = []

        def probe() -> None:
            try:
                socket.create_connection((host, port), timeout=timeout).close()
                ok.append(True)
            except OSError:
                pass

        t = threading.Thread(target=probe, daemon=True)
        t.start()
        t.join(timeout)
        _reachable[key] = bool(ok)
    return _reachable[key]


def go_offline() -> None:
    """Read the HF cache without asking the hub (also in libraries already imported)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    for mod, attr in (("huggingface_hub.constants", "HF_HUB_OFFLINE"),
                      ("datasets.config", "HF_HUB_OFFLINE"),
                      ("datasets.config", "HF_DATASETS_OFFLINE")):
        if mod in sys.modules and hasattr(sys.modules[mod], attr):
            setattr(sys.modules[mod], attr, True)


def is_hub_name(name: str) -> bool:
    """A name the hub could resolve, not a local path that is missing."""
    return bool(REPO_ID.match(name)) and not os.path.exists(os.path.expanduser(name))


def require_hub(key: str, name: str, cached: Callable[[], bool]) -> None:
    """Refuse hub name `name` (config key `key`) in one line when the hub cannot be
    reached and `cached()` says the HF cache does not have it. Not a hub name (a local
    path): nothing to check here."""
    if not is_hub_name(name) or (not offline_mode() and reachable()):
        return
    if cached():
        go_offline()
        return
    why = ("HF_HUB_OFFLINE is set" if offline_mode() else
           "the hub ({}:{}) cannot be reached from here (no connection in {:.0f} s)"
           .format(*_target(), PROBE_S))
    raise PreflightError(
        f"{key}={name!r} is a Hugging Face hub name, {why}, and the HF cache does not "
        f"have it; set {key} to a local path, or fill the HF cache on a machine with "
        "network (HF_HOME) and rerun with HF_HUB_OFFLINE=1")


def model_cached(repo: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except Exception:  # noqa: BLE001 - not a valid repo id, no cache: not cached
        return False


def dataset_cached(repo: str) -> bool:
    """A hub dataset the `datasets` cache or the hub cache holds (by its repo folder)."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        folder = os.path.join(HF_HUB_CACHE, "datasets--" + repo.replace("/", "--"))
        if os.path.isdir(os.path.join(folder, "snapshots")):
            return True
        from datasets.config import HF_DATASETS_CACHE

        return os.path.isdir(os.path.join(str(HF_DATASETS_CACHE), repo.replace("/", "___")))
    except Exception:  # noqa: BLE001
        return False


def dataset_revision(repo: str, revision: str = "main") -> str | None:
    """The commit of a hub dataset's `revision` as the hub cache last resolved it
    (refs/<revision>, written by every download that reached the hub), or None when the
    cache has no such ref. Read offline: what the job loads is that snapshot."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        ref = Path(HF_HUB_CACHE) / ("datasets--" + repo.replace("/", "--")) / "refs" / revision
        return ref.read_text().strip() or None
    except (OSError, ValueError):
        return None

