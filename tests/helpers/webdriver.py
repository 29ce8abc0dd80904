"""A minimal W3C WebDriver client (the standard library only) for headless Chromium through chromedriver:
open a page, run JavaScript in it, click, take a screenshot. For the optional browser checks."""
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from typing import Any, Optional, Tuple


def find_browser() -> Optional[Tuple[str, str]]:
    """(chromium, chromedriver) when both are installed, else None."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


class Browser:
    def __init__(self, browser: str, driver: str, size: Tuple[int, int] = (1400, 1000)):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen([driver, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                self._call("GET", "/status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.proc.kill()
                    raise
                time.sleep(0.1)
        options = {"binary": browser, "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                                               "--disable-dev-shm-usage", f"--window-size={size[0]},{size[1]}"]}
        self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "goog:chromeOptions": options}}})["sessionId"]

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())["value"]

    def open(self, url: str) -> None:
        self._call("POST", f"/session/{self.session}/url", {"url": url})

    def js(self, script: str, *args: Any) -> Any:
        return self._call("POST", f"/session/{self.session}/execute/sync", {"script": script, "args": list(args)})

    def wait_for(self, script: str, timeout: float = 60, *args: Any) -> Any:
        """Run ``script`` until it returns something truthy; that value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(script, *args)
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.5)

    def screenshot(self, path: str) -> bytes:
        png = base64.b64decode(self._call("GET", f"/session/{self.session}/screenshot"))
        with open(path, "wb") as f:
            f.write(png)
        return png

    def close(self) -> None:
        try:
            self._call("DELETE", f"/session/{self.session}")
        except OSError:
            pass
        finally:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
