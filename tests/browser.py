"""The built manual read in headless Chromium over http, as a reader's browser lays it out: which boxes (tables,
code blocks) a reader would have to scroll sideways at a window's width, and whether a page is wider than the
window. Chromium is the machine's (`chromium` on the PATH, or $CHROME); .ci/setup browser installs it.

Every page is laid out in an iframe of the width asked (Material's layout follows the width, as on a screen of
that size), all in one harness page: the harness's load event waits for every frame's, then its script measures
each frame and writes what it found into the DOM, which Chromium prints (--dump-dom). One browser start."""
from __future__ import annotations

import contextlib
import functools
import html
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Iterator, List, Optional, Sequence

# as the machine's own check starts it: no sandbox (root), no GPU, nothing fetched in the background
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")
HARNESS = "_boxes_harness.html"

MEASURE = """
addEventListener("load", () => {
  const found = {};
  for (const frame of document.querySelectorAll("iframe")) {
    const doc = frame.contentDocument, cut = [];
    const heading = (box) => {  // the section a box is in: the nearest heading above it
      for (let el = box; el && !el.matches("article"); el = el.parentElement) {
        for (let at = el.previousElementSibling; at; at = at.previousElementSibling) {
          if (/^H[1-4]$/.test(at.tagName)) return at.textContent.replace(/[\\u00b6#]/g, "").trim();
        }
      }
      return "(top)";
    };
    for (const box of doc.querySelectorAll(".md-typeset__scrollwrap, .md-typeset pre > code")) {
      if (box.scrollWidth > box.clientWidth + 1) {
        const kind = box.matches("code") ? "code block" : "table";
        cut.push(`${kind} under '${heading(box)}': ${box.scrollWidth} px in a ${box.clientWidth} px box`);
      }
    }
    const page = doc.documentElement.scrollWidth;
    if (page > frame.clientWidth) cut.push(`the page: ${page} px in a ${frame.clientWidth} px window`);
    found[frame.dataset.page] = cut;
  }
  document.getElementById("found").textContent = JSON.stringify(found);
});
"""


def chromium() -> Optional[str]:
    """The browser to read the site with: $CHROME, else chromium on the PATH (Debian's package)."""
    return os.environ.get("CHROME") or shutil.which("chromium") or shutil.which("chromium-browser")


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def served(folder: str) -> Iterator[str]:
    """`folder` served over http on a free port of 127.0.0.1 while inside: yields the site's address."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=folder))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def boxes_cut(site: str, pages: Sequence[str], width: int, height: int = 900) -> Dict[str, List[str]]:
    """For each page (a file of the built `site`), what a reader at a window `width` px wide would scroll
    sideways for: a table or code block wider than its box, or the page wider than the window."""
    browser = chromium()
    assert browser, "no Chromium here: bash .ci/setup browser installs it (or set $CHROME)"
    frames = "\n".join(f'<iframe data-page="{html.escape(p)}" src="{html.escape(p)}" '
                       f'style="width:{width}px;height:{height}px;border:0;display:block"></iframe>' for p in pages)
    with open(os.path.join(site, HARNESS), "w") as handle:
        handle.write(f"<!doctype html><html><body style='margin:0'>{frames}<pre id='found'></pre>"
                     f"<script>{MEASURE}</script></body></html>")
    try:
        with served(site) as url, tempfile.TemporaryDirectory() as profile:
            result = subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width + 40},"
                                     f"{height}", "--virtual-time-budget=20000", "--dump-dom", url + HARNESS],
                                    capture_output=True, text=True, timeout=180)
    finally:
        os.remove(os.path.join(site, HARNESS))
    found = re.search(r'<pre id="found">(.*?)</pre>', result.stdout, re.S)
    assert found and found.group(1), f"Chromium printed no measurement (exit {result.returncode}):\n" \
                                     f"{result.stderr[-3000:]}"
    return json.loads(html.unescape(found.group(1)))
