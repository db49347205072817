"""The hf layout (exporter/packaging/hf_layout.py) in a real browser: Debian's chromium, headless, opens
clients/transformersjs/web/index.html, where transformers.js 4 runs the export on onnxruntime-web's WASM
backend. Everything comes over HTTP from one loopback server, as it would from a web host: the page, the
transformers.js bundle and onnxruntime-web's .wasm from the client's node_modules, and the model folder
(config.json, onnx/model.onnx and its external data onnx/model.onnx_data). The tokens of a left-padded
batch of two rows are transformers' greedy ones."""

from __future__ import annotations

import asyncio
import collections
import http.server
import json
import os
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from exporter.packaging.hf_layout import write_hf_layout
from tests.test_hf_layout import NEW_TOKENS, check_rows, hf_generate, prompts, transformersjs  # noqa: F401 (fixture)
from tests.test_ui_browser import CHROMIUM, Browser

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")


class StaticSite(http.server.ThreadingHTTPServer):
    """A loopback web host: URL prefix -> folder, with the MIME types a browser insists on for WASM and
    ES modules, and a record of the bytes served per path (what the page really fetched)."""

    def __init__(self, roots: dict[str, Path]):
        self.roots = roots
        self.served: collections.Counter[str] = collections.Counter()
        super().__init__(("127.0.0.1", 0), _SiteHandler)  # port 0: the kernel picks a free one
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> StaticSite:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()

    def handle_error(self, request, client_address) -> None:
        # A browser drops connections it no longer needs (and all of them when it is closed): not an error.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _SiteHandler(http.server.SimpleHTTPRequestHandler):
    # WebAssembly.instantiateStreaming refuses anything but application/wasm; module scripts need a JS type.
    extensions_map = {".wasm": "application/wasm", ".mjs": "text/javascript", ".js": "text/javascript",
                      ".json": "application/json", ".html": "text/html"}
    server: StaticSite

    def translate_path(self, path: str) -> str:
        path = urllib.parse.unquote(path.split("?", 1)[0].split("#", 1)[0])
        for prefix, root in self.server.roots.items():
            if path.startswith(prefix):
                target = (root / path[len(prefix):]).resolve()
                if target.is_relative_to(root.resolve()):  # no `..` out of the folder
                    return str(target)
        return str(Path(os.devnull) / "missing")  # a 404

    def copyfile(self, source, outputfile) -> None:
        while chunk := source.read(1 << 20):
            outputfile.write(chunk)
            self.server.served[self.path.split("?", 1)[0]] += len(chunk)

    def log_message(self, format: str, *args) -> None:  # the record in `served` is the log that matters
        pass


async def page_result(url: str, profile: Path, timeout: float = 180) -> dict:
    """Open ``url`` in headless chromium and wait for the page to publish window.result."""
    browser = Browser(profile)
    try:
        async with browser as page:
            await page.goto(url)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if (result := await page.eval("window.result")) is not None:
                    return result
                await asyncio.sleep(0.2)
            raise TimeoutError(f"no result in {timeout}s; page status: {await page.eval('document.body.innerText')}")
    finally:
        browser.close()


def test_an_hf_layout_export_generates_transformers_tokens_in_a_browser_on_onnxruntime_web_wasm(
        exported, checkpoint, transformersjs, tmp_path):
    client = transformersjs.parent  # the page in web/, the bundle and the WASM build in node_modules/
    models = tmp_path / "models"
    write_hf_layout(exported("llama", "attn_dynamic"), models / "tiny-llama", checkpoint("llama"))
    ids, mask = prompts("llama")
    (models / "request.json").write_text(
        json.dumps({"input_ids": ids, "attention_mask": mask, "max_new_tokens": NEW_TOKENS}))

    with StaticSite({"/client/": client, "/models/": models}) as site:
        url = f"{site.url}/client/web/index.html?model=/models/tiny-llama&request=/models/request.json"
        result = asyncio.run(page_result(url, tmp_path / "chromium-profile"))
        served = dict(site.served)

    assert "error" not in result, result["error"]
    check_rows(result["sequences"], hf_generate(checkpoint("llama"), json.dumps(ids), json.dumps(mask)), ids,
               "transformers.js (onnxruntime-web, WASM)")
    # The weights came over HTTP as the model's external data, whole, with the graph that points at them.
    onnx_dir = models / "tiny-llama" / "onnx"
    assert served.get("/models/tiny-llama/onnx/model.onnx_data") == (onnx_dir / "model.onnx_data").stat().st_size
    assert served.get("/models/tiny-llama/onnx/model.onnx") == (onnx_dir / "model.onnx").stat().st_size
    # The runtime is the locally served WASM build, the very version the transformers.js bundle embeds.
    ort_dist = client / "node_modules" / "onnxruntime-web"
    assert served.get("/client/node_modules/onnxruntime-web/dist/ort-wasm-simd-threaded.asyncify.wasm") == \
        (ort_dist / "dist" / "ort-wasm-simd-threaded.asyncify.wasm").stat().st_size
    assert result["ort_web"] == json.loads((ort_dist / "package.json").read_text())["version"]
