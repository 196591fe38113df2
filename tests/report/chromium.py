"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``), stdlib only.

Chromium reads NUL-terminated JSON commands from fd 3 and writes responses and events to fd 4. One page
target is attached in flat mode; every console message, uncaught exception, log entry (CSP violations,
failed loads), JavaScript dialog (``alert``) and network request is recorded while the page loads.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: flags that work in this sandbox (root, no GPU, no network)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio", "--force-color-profile=srgb")


def find_chromium() -> str | None:
    """The Chromium binary: ``$IVQ_CHROMIUM`` or the first of the usual names on PATH."""
    env = os.environ.get("IVQ_CHROMIUM")
    if env and os.access(env, os.X_OK):
        return env
    for name in ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome", "chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


@dataclass
class PageLog:
    """What happened while a page was open."""

    console: list[dict[str, Any]] = field(default_factory=list)  # Runtime.consoleAPICalled (type, text)
    exceptions: list[str] = field(default_factory=list)  # Runtime.exceptionThrown
    log: list[dict[str, Any]] = field(default_factory=list)  # Log.entryAdded (level, source, text)
    dialogs: list[str] = field(default_factory=list)  # Page.javascriptDialogOpening messages
    requests: list[str] = field(default_factory=list)  # Network.requestWillBeSent URLs

    def errors(self) -> list[str]:
        """Console errors/asserts/warnings, exceptions, error/warning log entries and dialogs."""
        out = [f"console.{c['type']}: {c['text']}" for c in self.console if c["type"] in ("error", "assert", "warning")]
        out += [f"exception: {e}" for e in self.exceptions]
        out += [f"log {e['level']} ({e['source']}): {e['text']}" for e in self.log if e["level"] in ("error", "warning")]
        out += [f"dialog: {d}" for d in self.dialogs]
        return out


#: a DevTools reply on an idle machine comes within this (a screenshot takes about 3 s)
BASE_TIMEOUT_S = 30.0
#: ... scaled up to this on a loaded one
MAX_TIMEOUT_S = 300.0


def scaled_timeout(base: float) -> float:
    """``base`` times the machine's load per core (1-minute load average / cores, at least 1), at most
    :data:`MAX_TIMEOUT_S`: ``make test`` on 2 cores at load 14 gave ``test_screenshot_for_people`` its 30 s DevTools
    timeout for a 3 s screenshot once."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        load = 1.0
    return min(MAX_TIMEOUT_S, base * max(1.0, load))


class Chromium:
    """A headless Chromium with one page, controlled over the DevTools pipe. Use as a context manager."""

    def __init__(self, binary: str, timeout: float | None = None) -> None:
        self.timeout = scaled_timeout(BASE_TIMEOUT_S) if timeout is None else timeout
        self._profile = tempfile.mkdtemp(prefix="ivq-chromium-")
        to_child_r, self._w = os.pipe()  # commands: we write, Chromium reads fd 3
        self._r, from_child_w = os.pipe()  # replies: Chromium writes fd 4, we read

        def wire() -> None:  # runs in the child between fork and exec
            import fcntl

            # move both ends above fd 4 first: a pipe end may already sit on fd 3 or 4
            hi_r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
            hi_w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
            os.dup2(hi_r, 3, inheritable=True)
            os.dup2(hi_w, 4, inheritable=True)

        self.stderr_path = Path(self._profile) / "stderr.txt"
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self._profile}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._stderr, preexec_fn=wire,
            close_fds=False,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._next = 0
        self._events: list[dict[str, Any]] = []
        self.session: str | None = None
        self.log = PageLog()

    # ------------------------------------------------------------------ protocol
    def _read_message(self, deadline: float) -> dict[str, Any]:
        import select

        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply from Chromium")
            ready, _, _ = select.select([self._r], [], [], left)
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the pipe; stderr: {self._stderr_tail()}")
                self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def _record(self, ev: dict[str, Any]) -> None:
        m, p = ev.get("method"), ev.get("params", {})
        if m == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            self.log.console.append({"type": p.get("type"), "text": text})
        elif m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            self.log.exceptions.append(str(d.get("exception", {}).get("description") or d.get("text")))
        elif m == "Log.entryAdded":
            e = p.get("entry", {})
            self.log.log.append({"level": e.get("level"), "source": e.get("source"), "text": e.get("text")})
        elif m == "Page.javascriptDialogOpening":
            self.log.dialogs.append(str(p.get("message")))
            self.send("Page.handleJavaScriptDialog", {"accept": True}, wait=False)
        elif m == "Network.requestWillBeSent":
            self.log.requests.append(str(p.get("request", {}).get("url")))
        self._events.append(ev)

    def send(self, method: str, params: dict[str, Any] | None = None, *, session: bool = True,
             wait: bool = True) -> dict[str, Any]:
        """Send one command (to the attached page unless ``session=False``) and wait for its result."""
        self._next += 1
        mid = self._next
        msg: dict[str, Any] = {"id": mid, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        if not wait:
            return {}
        deadline = time.monotonic() + self.timeout
        while True:
            rep = self._read_message(deadline)
            if rep.get("id") == mid:
                if "error" in rep:
                    raise RuntimeError(f"{method}: {rep['error']}")
                return rep.get("result", {})
            self._record(rep)

    def wait_event(self, method: str, timeout: float | None = None) -> dict[str, Any]:
        """Wait for an event (already received ones count)."""
        for ev in self._events:
            if ev.get("method") == method:
                self._events.remove(ev)
                return ev
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            ev = self._read_message(deadline)
            self._record(ev)
            if ev.get("method") == method:
                self._events.remove(ev)
                return ev

    def drain(self, seconds: float) -> None:
        """Record events for a while (late console messages, timers)."""
        end = time.monotonic() + seconds
        try:
            while True:
                self._record(self._read_message(end))
        except TimeoutError:
            pass

    # ------------------------------------------------------------------ page
    def open(self, url: str, width: int = 1360, height: int = 900) -> PageLog:
        """Attach to the page, enable the recording domains, navigate and wait for ``load``."""
        targets = self.send("Target.getTargets", session=False)["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True},
                                 session=False)["sessionId"]
        for dom in ("Runtime", "Log", "Page", "Network"):
            self.send(f"{dom}.enable")
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        self.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired")
        self.drain(0.3)
        return self.log

    def reload(self) -> None:
        """Reload the page (fresh state) and wait for ``load``."""
        self.send("Page.reload", {"ignoreCache": True})
        self.wait_event("Page.loadEventFired")
        self.drain(0.2)

    def evaluate(self, expression: str) -> Any:
        """Evaluate JavaScript in the page and return its JSON value (exceptions raise)."""
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"evaluate failed: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    def screenshot(self, path: Path, max_height: int = 16000) -> Path:
        """Full-page PNG (up to ``max_height`` CSS pixels tall)."""
        h = int(self.evaluate("Math.ceil(document.documentElement.scrollHeight)") or 900)
        w = int(self.evaluate("Math.ceil(document.documentElement.scrollWidth)") or 1360)
        shot = self.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": w, "height": min(h, max_height), "scale": 1}})
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    # ------------------------------------------------------------------ lifecycle
    def _stderr_tail(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def close(self) -> None:
        """Ask Chromium to quit, then make sure it is gone; remove the profile folder."""
        try:
            self.send("Browser.close", session=False, wait=False)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass
        self._stderr.close()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
