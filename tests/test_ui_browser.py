"""A real browser on the pages of a running embedded farm: Debian's chromium, headless, driven over
the DevTools protocol. It signs in through the form (the cookie is the server's, set by the
response), loads the catalog and the page of a ready export, takes screenshots, and checks the DOM
it renders for the gate table and the benchmark image (loaded, not just referenced).

Screenshots go to $UI_SCREENSHOT_DIR when set (benchmarks/results/ui/ holds a set), else tmp.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests import farm
from tests.s3_server import free_ports

ADMIN = "browser-admin-token-0123456789abcd"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")


class Browser:
    """One headless chromium and one page, over the DevTools protocol (websockets)."""

    def __init__(self, profile: Path):
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
             "--remote-debugging-address=127.0.0.1", f"--user-data-dir={profile}", "--window-size=1200,900",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.is_file() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{self.port}/json/list", timeout=10).json()
        self.ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        self._id = 0

    async def __aenter__(self):
        import websockets

        self.ws = await websockets.connect(self.ws_url, max_size=64 << 20)
        await self.call("Page.enable")
        return self

    async def __aexit__(self, *exc):
        await self.ws.close()

    async def call(self, method: str, **params):
        self._id += 1
        await self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(await self.ws.recv())
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    async def wait_loaded(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = await self.eval("document.readyState")
            if state == "complete":
                return
            await asyncio.sleep(0.1)
        raise TimeoutError("page did not finish loading")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await asyncio.sleep(0.2)
        await self.wait_loaded()

    async def eval(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result.get("result", {}).get("value")

    async def screenshot(self, path: Path) -> None:
        data = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def running_farm(tmp_path_factory, checkpoint):
    root = tmp_path_factory.mktemp("browser-farm")
    models = root / "models"
    models.mkdir()
    (models / "tiny-llama").symlink_to(checkpoint("llama"))
    logs = root / "logs"
    logs.mkdir()
    env = {"DATA_DIR": str(root / "data"), "MODELS_DIR": str(models), "ADMIN_TOKEN": ADMIN, "HF_HUB_OFFLINE": "1",
           "BENCH_CONTEXTS": "[16, 32]", "BENCH_STEPS": "4", "DATABASE_URL": "", "REDIS_URL": "", "S3_ENDPOINT_URL": ""}
    port = free_ports(1)[0]
    serve = farm.serve(env, port, logs, name="serve-browser")
    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    try:
        farm.until(lambda: _healthy(http), bool, 60, "serve to answer")
        created = http.post("/exports", json={"model": "tiny-llama", "dtype": "fp32", "ep": "cpu"}).json()
        export = farm.until(lambda: http.get(f"/exports/{created['id']}").json(),
                            lambda e: e["status"] in ("ready", "failed", "quarantined"), 240, "the export to finish")
        assert export["status"] == "ready", export
        yield base, export["id"]
    finally:
        serve.stop()


def _healthy(http) -> bool:
    try:
        return http.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False


def test_a_browser_signs_in_and_sees_the_catalog_and_an_export(running_farm, tmp_path):
    base, export_id = running_farm
    shots = Path(os.environ.get("UI_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    profile = Path(tempfile.mkdtemp(prefix="chromium-", dir=tmp_path))
    browser = Browser(profile)

    async def run() -> dict:
        async with browser as page:
            await page.goto(f"{base}/ui/catalog")
            seen = {"redirected_to": await page.eval("location.pathname")}
            await page.eval(f"document.getElementById('token').value = {json.dumps(ADMIN)}; "
                            "document.querySelector('form[action=\"/ui/login\"]').submit(); true")
            await asyncio.sleep(0.5)
            await page.wait_loaded()
            seen["after_login"] = await page.eval("location.pathname")
            seen["cookie_visible_to_scripts"] = await page.eval("document.cookie")
            seen["catalog_rows"] = await page.eval("document.querySelectorAll('main table tbody tr').length")
            seen["catalog_text"] = await page.eval("document.querySelector('main').innerText")
            await page.screenshot(shots / "catalog.png")
            await page.goto(f"{base}/ui/exports/{export_id}")
            seen["gate_rows"] = await page.eval("document.querySelectorAll('#gates tbody tr').length")
            seen["gate_text"] = await page.eval("document.getElementById('gates').innerText")
            seen["image"] = await page.eval(
                "new Promise(r => { const i = document.getElementById('benchmark-plot');"
                " if (!i) return r(null); const done = () => r({w: i.naturalWidth, h: i.naturalHeight, src: i.src});"
                " i.complete ? done() : (i.onload = done, i.onerror = done); })")
            seen["files"] = await page.eval("document.getElementById('files').innerText")
            seen["url"] = await page.eval("location.href")
            (shots / "export.html").write_text(await page.eval("document.documentElement.outerHTML"))
            await page.screenshot(shots / "export.png")
            await page.call("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=2, mobile=True)
            await page.goto(f"{base}/ui/exports/{export_id}")
            seen["phone_overflow"] = await page.eval("document.documentElement.scrollWidth - window.innerWidth")
            await page.screenshot(shots / "export-phone.png")
            return seen

    try:
        seen = asyncio.run(run())
    finally:
        browser.close()
    assert seen["redirected_to"] == "/ui/login" and seen["after_login"] == "/ui/catalog"
    assert seen["cookie_visible_to_scripts"] == ""  # HttpOnly: scripts cannot read the session
    assert seen["catalog_rows"] >= 2 and "tiny-llama" in seen["catalog_text"] and "ready" in seen["catalog_text"]
    assert seen["gate_rows"] >= 8 and "prefill logits max abs error vs transformers" in seen["gate_text"]
    assert seen["image"] and seen["image"]["w"] > 100 and seen["image"]["h"] > 100, seen["image"]
    assert "model.onnx.data" in seen["files"] and ADMIN not in seen["url"]
    assert seen["phone_overflow"] <= 0  # nothing wider than a phone: wide tables scroll in their box
    for name in ("catalog.png", "export.png", "export-phone.png"):
        assert (shots / name).stat().st_size > 5000, name
